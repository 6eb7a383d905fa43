"""Multi-GPU Krea-2 on `torch.distributed`: Ulysses sequence parallelism and tensor parallelism, caching included.

    from dicache.parallel import setup_from_args, parallelize_pipeline
    ctx = setup_from_args(args)                    # --tp-size, --ulysses-degree; under torchrun
    pipe = Krea2Pipeline.from_pretrained(model, device=ctx.device)
    parallelize_pipeline(pipe, ctx)                # in place; a single-process context changes nothing
    dicache.enable(pipe)                           # cache decisions agree on every rank

Modules: `options` (the degrees, declared: `ParallelOptions`), `context` (ranks, groups, degree checks), `cli` (the
process group parsed options ask for), `tensor` (TP module surgery), `sequence` (Ulysses seams and attention),
`layout` (what the cache's diff counts on each rank), `krea2` (`parallelize`), `serving` (lockstep generations for
`dicache serve`).
"""

from .cli import setup_from_args
from .context import ParallelConfigError, ParallelContext, build_context, check_degrees, init_parallel
from .krea2 import check_parallel_model, parallelize, parallelize_pipeline
from .options import ParallelOptions
from .serving import LockstepBackend, lockstep

__all__ = [
    "LockstepBackend",
    "ParallelConfigError",
    "ParallelContext",
    "ParallelOptions",
    "build_context",
    "check_degrees",
    "check_parallel_model",
    "init_parallel",
    "lockstep",
    "parallelize",
    "parallelize_pipeline",
    "setup_from_args",
]
