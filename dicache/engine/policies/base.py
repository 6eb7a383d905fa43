"""The decision contract shared by all policies: plain data in, a `Decision` out. No tensors, no modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StepContext:
    """What a policy may look at for one transformer call of one branch.

    Attributes:
        step: 0-based denoising step index of this call.
        num_steps: steps in the request, or None when unknown (bare transformer without `dicache.request`).
        cached_total: cached steps of this branch so far in the request.
        continuous_cached: length of this branch's current run of consecutive cached steps.
        has_residual: a middle residual is stored for this branch (something to reuse).
        has_reference: an Fn residual from the last computed step is stored (something to diff against).
        sigma: the scheduler's noise level at this step, when the caller knows it.
    """

    step: int
    num_steps: int | None
    cached_total: int
    continuous_cached: int
    has_residual: bool
    has_reference: bool
    sigma: float | None = None


@dataclass(frozen=True)
class Decision:
    """Compute the middle blocks (`cache=False`) or reuse them (`cache=True`), and why.

    `reason` is one of: warmup, mask, max_cached, max_continuous, threshold_off, no_residual, diff, policy.
    `diff` is the relative Fn-residual change when it was measured (rule 7), else None.
    """

    cache: bool
    reason: str
    diff: float | None = None


DiffFn = Callable[[], float]
"""Computes the relative Fn-residual change on demand; policies call it only when it decides the outcome."""


class CachePolicy(Protocol):
    """What the engine asks of a policy.

    `uses_diff`: whether any decision of this policy can measure a diff; when False the engine never stores the Fn
    reference residual a diff needs (a class attribute or a property). `decide`: the decision for one call; it calls
    `diff()` only when the diff decides the outcome.
    """

    @property
    def uses_diff(self) -> bool: ...

    def decide(self, ctx: StepContext, diff: DiffFn) -> Decision: ...


def compute(reason: str, diff: float | None = None) -> Decision:
    return Decision(cache=False, reason=reason, diff=diff)


def cache(reason: str, diff: float | None = None) -> Decision:
    return Decision(cache=True, reason=reason, diff=diff)
