"""The residual diff a dynamic decision reads, reduced over the processes that share a model (docs/architecture.md
§2, §5): `relative_change`, and the `ReductionLayout` a model split over processes carries under
`PARALLEL_LAYOUT_ATTR`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

PARALLEL_LAYOUT_ATTR = "parallel_layout"
"""A model split over processes carries a `ReductionLayout` under this attribute (set by `dicache.parallel`)."""


class ReductionLayout(Protocol):
    """How this process's residual streams are a share of the whole, for sums that must cover the whole once.

    group: the processes that must reach the same decision (the model-parallel group), or None for no reduction.
    counted(stream): the part of this process's stream `(B, S_local, ...)` that counts toward the sums; over `group`
        every element of the whole is counted on exactly one process (replicated copies count once).
    """

    group: Any

    def counted(self, stream: torch.Tensor) -> torch.Tensor: ...


def relative_change(
    current: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], layout: ReductionLayout | None = None
) -> float:
    """`mean|current − reference| / mean|reference|` over every element of every stream (one tensor per stream, the
    same shapes in both; one host sync).

    With a layout, each process sums only what it counts and the numerator and denominator sums are all-reduced over
    its group before dividing, so every process of a model-parallel group gets the same value, equal to the
    single-process one up to summation order (unequal shards weigh by their element counts).
    """
    return change_ratio(current, reference, reference, None, layout)


def change_ratio(
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    c: Sequence[torch.Tensor],
    d: Sequence[torch.Tensor] | None = None,
    layout: ReductionLayout | None = None,
) -> float:
    """`Σ|a − b| / Σ|c − d|` (`Σ|c|` when `d` is None) over every element of every stream, reduced over the layout's
    group as `relative_change` is (one host sync); a zero denominator gives `inf`."""
    if layout is not None:
        a, b, c = (tuple(layout.counted(t) for t in ts) for ts in (a, b, c))
        d = None if d is None else tuple(layout.counted(t) for t in d)
    num = sum(torch.sub(x, y).abs().sum(dtype=torch.float32) for x, y in zip(a, b))
    if d is None:
        den = sum(x.abs().sum(dtype=torch.float32) for x in c)
    else:
        den = sum(torch.sub(x, y).abs().sum(dtype=torch.float32) for x, y in zip(c, d))
    both = torch.stack([num, den]).detach()
    if layout is not None and layout.group is not None:
        both = both.double()
        dist.all_reduce(both, group=layout.group)
    num, den = both.tolist()  # the one host synchronisation of a decision
    return num / den if den > 0 else float("inf")
