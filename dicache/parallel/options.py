"""The model-parallel degrees, declared once (`ParallelOptions`) for `dicache generate`, `dicache serve` and the Ray
Serve builder; `check_degrees` checks them against the processes launched."""

from __future__ import annotations

from typing import ClassVar

from ..settings.options import FlagOptions, option


class ParallelOptions(FlagOptions):
    """tp × ulysses GPUs per model; both 1: one process."""

    group: ClassVar[tuple[str, str]] = (
        "model parallelism",
        "run one model on N = tp × ulysses GPUs: launch with `torchrun --nproc_per_node N …`",
    )

    ulysses_degree: int = option(
        1,
        flag="--ulysses-degree",
        ge=1,
        metavar="N",
        help="sequence parallelism: image tokens split over N GPUs, text replicated; output bitwise equal to one GPU",
    )
    tp_size: int = option(
        1,
        flag="--tp-size",
        ge=1,
        metavar="N",
        help="tensor parallelism: transformer weights split over N GPUs (less memory per GPU; output equal to one GPU "
        "within bf16 rounding)",
    )
