"""`BlockStackRunner`: runs a block stack as Fn / middle / Bn (docs/architecture.md §2).

It runs the first Fn blocks, asks the request's policy whether the middle can be skipped, and either runs the middle
blocks (storing the residuals) or adds the calibrator's estimate of the middle residual, then runs the last Bn blocks.
It keeps the stack's `BlockObserver`s informed (`dicache.engine.block_plan`); a model with observers but no cache gets a
runner too (every call runs all blocks). `dicache.engine.install` puts the runner in place on a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .adapters.base import ModelSpec, Streams
from .block_plan import BlockObserver, BlockPlan, CallInfo, publish
from .policies import StepContext
from .policies.lookahead import BranchCounters, decide_without_diff, upcoming_decisions
from .reduction import PARALLEL_LAYOUT_ATTR, relative_change
from .session import CacheSession


class BlockStackRunner:
    """Runs a block stack as Fn / middle / Bn for the call context the session reports, and keeps the stack's
    observers informed.

    Args:
        spec: the model's block stack and block form.
        plain: runs the whole stack without caching (the model's own loop), used when nothing needs the runner.
        session: request/call bookkeeping of the cache (None: no caching; every call runs all blocks).
    """

    def __init__(self, spec: ModelSpec, plain: Callable[..., Any], session: CacheSession | None = None) -> None:
        self.session = session
        self.spec = spec
        self.blocks = spec.blocks
        self.form = spec.form
        self.plain = plain
        self.observers: list[BlockObserver] = []

    def _run(self, indices: range, streams: Streams, args: tuple, kwargs: dict, observers: tuple) -> Streams:
        for i in indices:
            for observer in observers:
                observer.before_block(i)
            streams = self.form.call(self.blocks[i], streams, args, kwargs)
            for observer in observers:
                observer.after_block(i)
        return streams

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self.session.current_call() if self.session is not None else None
        observers = tuple(self.observers)
        if ctx is None and not observers:
            return self.plain(*args, **kwargs)
        info = CallInfo(ctx.step, ctx.branch.name) if ctx is not None else CallInfo()
        for observer in observers:
            observer.begin_call(info)
        try:
            streams, rest, kw = self.form.split(args, kwargs)
            if ctx is None or not ctx.request.enabled:
                everything = tuple(range(len(self.blocks)))
                publish(observers, BlockPlan(everything, True, everything))
                out = self._run(range(len(self.blocks)), streams, rest, kw, observers)
                if ctx is not None:
                    ctx.branch.stats.record(ctx.step, False, "disabled", None)
                return self.form.join(out)
            return self.form.join(self._cached_call(ctx, streams, rest, kw, observers))
        finally:
            for observer in reversed(observers):
                observer.end_call()

    def _cached_call(self, ctx, h0: Streams, rest: tuple, kw: dict, observers: tuple) -> Streams:
        request, branch = ctx.request, ctx.branch
        num_blocks = len(self.blocks)
        config = request.config
        fn, bn = config.Fn_compute_blocks, config.Bn_compute_blocks

        fn_residual: list[Streams] = []
        hf: Streams = ()

        def residual() -> Streams:
            if not fn_residual:
                fn_residual.append(tuple(torch.sub(a, b) for a, b in zip(hf, h0)))
            return fn_residual[0]

        def diff() -> float:
            layout = getattr(self.spec.owner, PARALLEL_LAYOUT_ATTR, None)
            return relative_change(residual(), branch.reference, layout)

        policy = request.policy
        step_ctx = StepContext(
            step=ctx.step,
            num_steps=request.num_steps,
            cached_total=branch.cached_total,
            continuous_cached=branch.continuous_cached,
            has_residual=branch.has_residual,
            has_reference=branch.reference is not None,
            sigma=ctx.sigma,
        )
        # Rules that do not read the diff decide before any block runs (same answer: decisions are pure), so the
        # observers learn the whole call up front; otherwise they learn the Fn blocks now and the rest after them.
        early = decide_without_diff(policy, step_ctx) if observers else None
        if observers:
            known = self._call_plan(early.cache, fn, bn, request.segments) if early is not None else tuple(range(fn))
            publish(observers, BlockPlan(known, early is not None, self._upcoming(ctx, early and early.cache)))
        hf = self._run(range(fn), h0, rest, kw, observers)
        decision = early if early is not None else policy.decide(step_ctx, diff)
        if observers and early is None:
            full = self._call_plan(decision.cache, fn, bn, request.segments)
            publish(observers, BlockPlan(full, True, self._upcoming(ctx, decision.cache)))

        position = request.position(ctx.step, ctx.sigma) if config.enable_taylorseer else float(ctx.step)
        streams_n = len(hf)
        h, slot = hf, 0  # slot: the first calibrator of the next cached segment (segment-major, stream-minor)
        if decision.cache:
            for segment in request.segments:  # skipped runs add their estimate; cached_step_blocks still run
                if segment.cached:
                    calibrators = branch.calibrators[slot : slot + streams_n]
                    h = tuple(a + c.estimate(position) for a, c in zip(h, calibrators))
                    slot += streams_n
                else:
                    h = self._run(range(segment.start, segment.stop), h, rest, kw, observers)
            branch.cached_total += 1
            branch.continuous_cached += 1
        else:
            if policy.uses_diff:
                branch.reference = residual()
            for segment in request.segments:
                out = self._run(range(segment.start, segment.stop), h, rest, kw, observers)
                if segment.cached:  # what this run adds, for the cached steps to come
                    for calibrator, a, b in zip(branch.calibrators[slot : slot + streams_n], out, h):
                        calibrator.update(position, torch.sub(a, b))
                    slot += streams_n
                h = out
            branch.continuous_cached = 0
        h = self._run(range(num_blocks - bn, num_blocks), h, rest, kw, observers)
        branch.stats.record(ctx.step, decision.cache, decision.reason, decision.diff)
        return h

    def _call_plan(self, cache: bool, fn: int, bn: int, segments: Sequence = ()) -> tuple[int, ...]:
        """All blocks on a computed call; on a cached one the Fn blocks, the middle blocks it still computes (the
        uncached `segments`, i.e. `cached_step_blocks`), then the Bn blocks."""
        num_blocks = len(self.blocks)
        if not cache:
            return tuple(range(num_blocks))
        kept = tuple(b for seg in segments if not seg.cached for b in range(seg.start, seg.stop))
        return tuple(range(fn)) + kept + tuple(range(num_blocks - bn, num_blocks))

    def _upcoming(self, ctx, current_cache: bool | None) -> tuple[int, ...]:
        """The blocks of the calls after this one, as far as the policy knows them: at least one stack's worth when
        it can (a static mask knows the whole request); an undecided call contributes its Fn blocks and ends the list.
        """
        request = ctx.request
        config = request.config
        fn, bn, num_blocks = config.Fn_compute_blocks, config.Bn_compute_blocks, len(self.blocks)
        counters = {
            name: BranchCounters(b.cached_total, b.continuous_cached, b.has_residual, b.reference is not None)
            for name, b in request.branches.items()
        }
        upcoming: list[int] = []
        calls = upcoming_decisions(
            request.policy,
            counters,
            list(request.branches),
            ctx.step,
            ctx.branch.name,
            current_cache,
            request.num_steps,
            request.sigmas,
            max_calls=2 * (request.num_steps or 1) * max(len(counters), 1) + 2,
        )
        for call in calls:
            if call.cache is None:
                upcoming.extend(range(fn))
                break
            upcoming.extend(self._call_plan(call.cache, fn, bn, request.segments))
            if len(upcoming) >= num_blocks:
                break
        return tuple(upcoming)
