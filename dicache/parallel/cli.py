"""Command-line options for model parallelism, shared by `dicache generate` and `dicache serve`."""

from __future__ import annotations

import argparse

from .context import ParallelContext, init_parallel


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--ulysses-degree N` and `--tp-size N` (both default 1) to `parser`."""
    group = parser.add_argument_group(
        "model parallelism", "run one model on N = tp × ulysses GPUs: launch with `torchrun --nproc_per_node N …`"
    )
    group.add_argument(
        "--ulysses-degree",
        type=int,
        default=1,
        metavar="N",
        help="sequence parallelism: image tokens split over N GPUs, text replicated; output bitwise equal to one GPU "
        "(default: 1)",
    )
    group.add_argument(
        "--tp-size",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallelism: transformer weights split over N GPUs (less memory per GPU; output equal to one GPU "
        "within bf16 rounding) (default: 1)",
    )


def setup_from_args(args: argparse.Namespace) -> ParallelContext:
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
