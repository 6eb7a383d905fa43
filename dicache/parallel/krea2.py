"""Split a Krea-2 transformer (or the transformer of a pipeline) over a `ParallelContext`, in place.

Order: tensor parallelism (weights sliced per TP rank), then Ulysses (sequence seams + attention kernels), then the
cache's reduction layout under the model's `parallel_layout` attribute. Works before or after `dicache.enable` (the
hook layer reads the layout at every decision), but not while a request is running. Model code stays cache-free.
"""

from __future__ import annotations

from typing import Any

from ..engine.reduction import PARALLEL_LAYOUT_ATTR
from ..models.krea2.transformer import Krea2Transformer
from .context import ParallelConfigError, ParallelContext
from .layout import TokenShareLayout
from .sequence import apply_sequence_parallel, sequence_parallel_problems
from .tensor import apply_tensor_parallel, tensor_parallel_problems


def check_parallel_model(model: Krea2Transformer, tp_size: int, ulysses_degree: int) -> None:
    """Raise `ParallelConfigError` listing every head / feature count the degrees do not divide.

    Image attention heads split over `tp × ulysses`, text-fusion heads and SwiGLU widths over `tp` only. Full size
    (48 query / 12 key-value image heads, 20 text heads): tp 1, 2 or 4, and tp × ulysses dividing 12.
    """
    problems = tensor_parallel_problems(model, tp_size) if tp_size > 1 else []
    if ulysses_degree > 1:  # each process attends H / (tp × ulysses) image heads
        problems += sequence_parallel_problems(model, tp_size * ulysses_degree)
    if problems:
        shown = "; ".join(dict.fromkeys(p.split(": ", 1)[1] for p in problems))
        raise ParallelConfigError(
            f"--tp-size {tp_size} × --ulysses-degree {ulysses_degree} does not fit this model: {shown}"
        )


def parallelize(model: Krea2Transformer, ctx: ParallelContext) -> Krea2Transformer:
    """Split `model` over `ctx` in place and return it (a single-process context leaves it untouched).

    Every process must call this with a model holding the same full weights; afterwards each holds its share (TP) and
    computes its tokens (Ulysses); outputs are full and identical on every process.
    """
    if not ctx.enabled:
        return model
    if not isinstance(model, Krea2Transformer):
        raise TypeError(f"dicache.parallel supports the native Krea2Transformer, not {type(model).__name__}")
    if getattr(model, PARALLEL_LAYOUT_ATTR, None) is not None:
        raise RuntimeError("this transformer is already parallelized")
    check_parallel_model(model, ctx.tp_size, ctx.sp_size)
    if ctx.tp_size > 1:
        apply_tensor_parallel(model, ctx.tp_rank, ctx.tp_size, ctx.tp_group)
    shard = apply_sequence_parallel(model, ctx.sp_rank, ctx.sp_size, ctx.sp_group) if ctx.sp_size > 1 else None
    setattr(model, PARALLEL_LAYOUT_ATTR, TokenShareLayout(ctx.group, ctx.tp_rank, ctx.sp_rank, shard))
    return model


def parallelize_pipeline(pipe: Any, ctx: ParallelContext) -> Any:
    """`parallelize(pipe.transformer, ctx)`; returns `pipe`. Load the pipeline on `ctx.device` first."""
    parallelize(pipe.transformer, ctx)
    return pipe
