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
        accumulated: the branch's accumulator as this policy's last decision left it (`Decision.accumulated`; 0 after
            a computed step): TeaCache's rescaled distance, EasyCache's predicted change.
        rate: EasyCache's transformation rate, measured on the branch's last two computed steps (None before).
    """

    step: int
    num_steps: int | None
    cached_total: int
    continuous_cached: int
    has_residual: bool
    has_reference: bool
    sigma: float | None = None
    accumulated: float = 0.0
    rate: float | None = None


@dataclass(frozen=True)
class Decision:
    """Compute the middle blocks (`cache=False`) or reuse them (`cache=True`), and why.

    `reason` is one of: warmup, mask, max_cached, max_continuous, threshold_off, no_residual, diff, policy, and for
    TeaCache / MagCache / EasyCache also last_step, accumulated, ratio.
    `diff` is the measured signal when one was read (the relative Fn-residual change for DBCache), else None.
    `accumulated`: the branch's accumulator after this call (None: 0), handed back in the next `StepContext`.
    """

    cache: bool
    reason: str
    diff: float | None = None
    accumulated: float | None = None


DiffFn = Callable[[], float]
"""Computes the policy's signal on demand (see `SIGNALS`); policies call it only when it decides the outcome."""

SIGNALS = ("fn_residual", "fn_residual_consecutive", "input_change")
"""What a policy's `diff()` measures (its `signal` attribute, default the first), each reduced over the model-parallel
group (`engine/reduction.py`): `fn_residual`, the relative change of the Fn residual since the branch's last computed
call (DBCache); `fn_residual_consecutive`, the same against the previous call, computed or cached (TeaCache);
`input_change`, `mean|x − x_prev| / mean|y_last|` with `x` the stack's input streams, `x_prev` the previous call's
and `y_last` the middle's output on the last computed call (EasyCache, which also gets `StepContext.rate`)."""


class CachePolicy(Protocol):
    """What the engine asks of a policy.

    `uses_diff`: whether any decision of this policy can measure a diff; when False the engine never stores the Fn
    reference residual a diff needs (a class attribute or a property). `signal`: what `diff()` measures (`SIGNALS`;
    an optional attribute, default `fn_residual`). `decide`: the decision for one call; it calls `diff()` only when the
    diff decides the outcome, and never changes anything (the engine keeps `Decision.accumulated`).
    """

    @property
    def uses_diff(self) -> bool: ...

    def decide(self, ctx: StepContext, diff: DiffFn) -> Decision: ...


def compute(reason: str, diff: float | None = None) -> Decision:
    return Decision(cache=False, reason=reason, diff=diff)


def cache(reason: str, diff: float | None = None, accumulated: float | None = None) -> Decision:
    return Decision(cache=True, reason=reason, diff=diff, accumulated=accumulated)


def accumulator_gate(ctx: StepContext, warmup: int, mask: list[int] | None, threshold: float) -> Decision | None:
    """What every accumulating policy (TeaCache, EasyCache) computes before reading its signal: warm-up steps, the
    last step of a request, steps the mask computes, and everything when `threshold <= 0`; None: the signal decides."""
    s = ctx.step
    if s < warmup:
        return compute("warmup")
    if ctx.num_steps is not None and s >= ctx.num_steps - 1:
        return compute("last_step")
    if mask is not None and (s >= len(mask) or mask[s] == 1):
        return compute("mask")
    if threshold <= 0:
        return compute("threshold_off")
    return None
