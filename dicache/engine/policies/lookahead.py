"""Decisions known before the diff: this call's when no rule needs the diff, and later calls' ahead of time.

A policy's `decide(ctx, diff)` is pure; rules that do not read the diff (warm-up, step masks, caps) give their answer
from the counters alone. `decide_without_diff` asks for it and returns None where the diff would decide.
`upcoming_decisions` rolls a request's branch counters forward over the calls that follow the current one, as far as
those decisions are known: with a static step mask that is the whole rest of the request, with the dynamic policy it
ends at the first call whose decision needs a diff. Nothing here knows about memory or modules.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from .base import CachePolicy, Decision, StepContext


class _DiffNeeded(Exception):
    pass


def _no_diff() -> float:
    raise _DiffNeeded


def decide_without_diff(policy: CachePolicy, ctx: StepContext) -> Decision | None:
    """`policy.decide(ctx, ...)` when no rule needs the residual diff for this context, else None."""
    try:
        return policy.decide(ctx, _no_diff)
    except _DiffNeeded:
        return None


@dataclass(frozen=True)
class BranchCounters:
    """What a policy reads of one branch between its calls (the counters of a `StepContext`)."""

    cached_total: int = 0
    continuous_cached: int = 0
    has_residual: bool = False
    has_reference: bool = False

    def after(self, cached: bool, uses_diff: bool) -> BranchCounters:
        """The counters once a call of this branch was cached (`cached`) or computed."""
        if cached:
            return replace(self, cached_total=self.cached_total + 1, continuous_cached=self.continuous_cached + 1)
        return replace(self, continuous_cached=0, has_residual=True, has_reference=self.has_reference or uses_diff)

    def context(self, step: int, num_steps: int | None, sigma: float | None = None) -> StepContext:
        return StepContext(
            step=step,
            num_steps=num_steps,
            cached_total=self.cached_total,
            continuous_cached=self.continuous_cached,
            has_residual=self.has_residual,
            has_reference=self.has_reference,
            sigma=sigma,
        )


@dataclass(frozen=True)
class UpcomingCall:
    """A call after the current one: its step, branch and decision (`cache` None: needs a diff, not known yet)."""

    step: int
    branch: str
    cache: bool | None


def next_call(step: int, branch: str, order: Sequence[str]) -> tuple[int, str]:
    """The call after `(step, branch)` when every step calls the branches in `order` (the order seen so far)."""
    names = list(order) or [branch]
    if branch in names and names.index(branch) + 1 < len(names):
        return step, names[names.index(branch) + 1]
    return step + 1, names[0]


def upcoming_decisions(
    policy: CachePolicy,
    counters: Mapping[str, BranchCounters],
    order: Sequence[str],
    step: int,
    branch: str,
    current_cache: bool | None,
    num_steps: int | None,
    sigmas: Sequence[float] | None = None,
    max_calls: int = 64,
) -> Iterator[UpcomingCall]:
    """The calls after `(step, branch)` in order, each with its decision while decisions are known.

    counters: each branch's counters before the current call; `current_cache`: the current call's decision (None:
    not known yet). Stops after the first call whose decision is unknown, at the end of the request (`num_steps`),
    or after `max_calls` calls. A branch never seen yet starts from empty counters.
    """
    uses_diff = policy.uses_diff
    state: dict[str, BranchCounters | None] = dict(counters)
    before = state.get(branch, BranchCounters())
    state[branch] = None if current_cache is None else before.after(current_cache, uses_diff)
    for _ in range(max_calls):
        step, branch = next_call(step, branch, order)
        if num_steps is not None and step >= num_steps:
            return
        now = state.get(branch, BranchCounters())
        decision = None
        if now is not None:
            sigma = sigmas[step] if sigmas is not None and step < len(sigmas) else None
            decision = decide_without_diff(policy, now.context(step, num_steps, sigma))
        cache = None if decision is None else decision.cache
        yield UpcomingCall(step, branch, cache)
        if cache is None:
            return
        state[branch] = now.after(cache, uses_diff)
