"""The process group a command's parsed options ask for (`--tp-size`, `--ulysses-degree`: `ParallelOptions`)."""

from __future__ import annotations

from typing import Any

from .context import ParallelContext, init_parallel


def setup_from_args(args: Any) -> ParallelContext:
    """Join the process group the options ask for and return this process's `ParallelContext`.

    Reads `args.tp_size`, `args.ulysses_degree` and `args.device` (when present: its type picks CUDA/NCCL or
    CPU/gloo; under torchrun each process takes GPU `LOCAL_RANK`). Both degrees 1 in a single process: a plain
    context, nothing initialised. Raises `ParallelConfigError` (a `DicacheError`) when tp × ulysses differs from
    the number of processes launched.
    """
    return init_parallel(
        tp_size=getattr(args, "tp_size", 1),
        ulysses_degree=getattr(args, "ulysses_degree", 1),
        device=getattr(args, "device", None),
    )
