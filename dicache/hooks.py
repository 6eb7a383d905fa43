"""The hook layer: the only code that touches `nn.Module`s.

`BlockStackRunner` runs a block stack as Fn / middle / Bn (DESIGN §2): it runs the first Fn blocks, asks the
request's policy whether the middle can be skipped, and either runs the middle blocks (storing the residuals) or
adds the calibrator's estimate of the middle residual, then runs the last Bn blocks.

`install` attaches a runner to a model described by a `ModelSpec`, in one of two ways, both reversible:
- seam: the model runs its stack through a method (`run_blocks`); the runner replaces it on the instance;
- iteration: the stack's `ModuleList` yields the runner in place of its blocks while a transformer call is active,
  so a model looping `for block in blocks: x = block(x, ...)` calls the runner once per forward.
Blocks themselves are never modified, so their own hooks and `torch.compile` keep working. The owner's forward is
wrapped to give each call its (step, branch): declared by the pipeline, or derived from the timestep.
A model split over processes carries a `ReductionLayout` (`parallel_layout`); the diff is then reduced over its group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .adapters.base import ModelSpec, Streams
from .policies import StepContext
from .session import CacheSession

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


def relative_change(current: Streams, reference: Streams, layout: ReductionLayout | None = None) -> float:
    """`mean|current − reference| / mean|reference|` over every element of every stream (one host sync).

    With a layout, each process sums only what it counts and the numerator and denominator sums are all-reduced over
    its group before dividing, so every process of a model-parallel group gets the same value, equal to the
    single-process one up to summation order (unequal shards weigh by their element counts).
    """
    if layout is not None:
        current = tuple(layout.counted(a) for a in current)
        reference = tuple(layout.counted(b) for b in reference)
    num = sum(torch.sub(a, b).abs().sum(dtype=torch.float32) for a, b in zip(current, reference))
    den = sum(b.abs().sum(dtype=torch.float32) for b in reference)
    both = torch.stack([num, den]).detach()
    if layout is not None and layout.group is not None:
        import torch.distributed as dist

        both = both.double()
        dist.all_reduce(both, group=layout.group)
    num, den = both.tolist()  # the one host synchronisation of a decision
    return num / den if den > 0 else float("inf")


class BlockStackRunner:
    """Runs a block stack as Fn / middle / Bn for the call context the session reports.

    Args:
        session: request/call bookkeeping for this model.
        spec: the model's block stack and block form.
        plain: runs the whole stack without caching (the model's own loop), used outside any call context.
    """

    def __init__(self, session: CacheSession, spec: ModelSpec, plain: Callable[..., Any]) -> None:
        self.session = session
        self.spec = spec
        self.blocks = spec.blocks
        self.form = spec.form
        self.plain = plain

    def _run(self, start: int, stop: int, streams: Streams, args: tuple, kwargs: dict) -> Streams:
        for i in range(start, stop):
            streams = self.form.call(self.blocks[i], streams, args, kwargs)
        return streams

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self.session.current_call()
        if ctx is None:
            return self.plain(*args, **kwargs)
        request, branch = ctx.request, ctx.branch
        streams, rest, kw = self.form.split(args, kwargs)
        num_blocks = len(self.blocks)
        if not request.enabled:
            out = self._run(0, num_blocks, streams, rest, kw)
            branch.stats.record(ctx.step, False, "disabled", None)
            return self.form.join(out)

        config = request.config
        fn, bn = config.Fn_compute_blocks, config.Bn_compute_blocks
        h0 = streams
        hf = self._run(0, fn, h0, rest, kw)

        fn_residual: list[Streams] = []

        def residual() -> Streams:
            if not fn_residual:
                fn_residual.append(tuple(torch.sub(a, b) for a, b in zip(hf, h0)))
            return fn_residual[0]

        def diff() -> float:
            layout = getattr(self.spec.owner, PARALLEL_LAYOUT_ATTR, None)
            return relative_change(residual(), branch.reference, layout)

        policy = request.policy
        decision = policy.decide(
            StepContext(
                step=ctx.step,
                num_steps=request.num_steps,
                cached_total=branch.cached_total,
                continuous_cached=branch.continuous_cached,
                has_residual=branch.has_residual,
                has_reference=branch.reference is not None,
                sigma=ctx.sigma,
            ),
            diff,
        )
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
                    h = self._run(segment.start, segment.stop, h, rest, kw)
            branch.cached_total += 1
            branch.continuous_cached += 1
        else:
            if getattr(policy, "uses_diff", True):
                branch.reference = residual()
            for segment in request.segments:
                out = self._run(segment.start, segment.stop, h, rest, kw)
                if segment.cached:  # what this run adds, for the cached steps to come
                    for calibrator, a, b in zip(branch.calibrators[slot : slot + streams_n], out, h):
                        calibrator.update(position, torch.sub(a, b))
                    slot += streams_n
                h = out
            branch.continuous_cached = 0
        h = self._run(num_blocks - bn, num_blocks, h, rest, kw)
        branch.stats.record(ctx.step, decision.cache, decision.reason, decision.diff)
        return self.form.join(h)


class _StackIteration:
    """Mixin for a hooked `ModuleList`: while a call is active, iterating yields the runner instead of the blocks."""

    def __iter__(self):
        runner = self.__dict__.get("_dicache_runner")
        if runner is not None and runner.session.current_call() is not None:
            return iter((runner,))
        return super().__iter__()


_ITERATION_CLASSES: dict[type, type] = {}


def _iteration_class(base: type) -> type:
    cls = _ITERATION_CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_StackIteration, base), {"__module__": base.__module__})
        _ITERATION_CLASSES[base] = cls
    return cls


def _timestep_key(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.reshape(-1)[0])  # a host sync on GPU; pipelines we know avoid it with a key source
    if isinstance(value, int | float):
        return float(value)
    raise TypeError(f"dicache: cannot derive the denoising step from a timestep of type {type(value).__name__}")


@dataclass
class InstalledHooks:
    """What `install` changed on a model; `remove()` restores it exactly."""

    spec: ModelSpec
    session: CacheSession
    runner: BlockStackRunner
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def _set_instance_attr(obj: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
    had, previous = name in obj.__dict__, obj.__dict__.get(name)

    def restore() -> None:
        if had:
            obj.__dict__[name] = previous
        else:
            obj.__dict__.pop(name, None)

    obj.__dict__[name] = value
    undo.append(restore)


def install(spec: ModelSpec, session: CacheSession) -> InstalledHooks:
    """Attach a `BlockStackRunner` and a call-deriving forward wrapper to `spec.owner`."""
    owner, blocks = spec.owner, spec.blocks
    undo: list[Callable[[], None]] = []

    if spec.seam is not None:
        original_seam = getattr(owner, spec.seam)
        runner = BlockStackRunner(session, spec, plain=original_seam)
        _set_instance_attr(owner, spec.seam, runner, undo)
    else:

        def plain(*args: Any, **kwargs: Any) -> Any:
            streams, rest, kw = spec.form.split(args, kwargs)
            for block in nn.ModuleList.__iter__(blocks):
                streams = spec.form.call(block, streams, rest, kw)
            return spec.form.join(streams)

        runner = BlockStackRunner(session, spec, plain=plain)
        base = type(blocks)
        blocks.__class__ = _iteration_class(base)
        blocks.__dict__["_dicache_runner"] = runner

        def restore_iteration() -> None:
            blocks.__class__ = base
            blocks.__dict__.pop("_dicache_runner", None)

        undo.append(restore_iteration)

    original_forward = owner.forward

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        current = session.current_call()
        if current is not None and current.explicit:
            return original_forward(*args, **kwargs)
        request = session.active_request()
        if request is not None and request.key_source is not None:
            key = request.key_source()
        else:
            key = _timestep_key(spec.timestep(args, kwargs))
        token = session.derive_call(key)
        try:
            return original_forward(*args, **kwargs)
        finally:
            session.end_call(token)

    _set_instance_attr(owner, "forward", forward, undo)
    return InstalledHooks(spec=spec, session=session, runner=runner, _undo=undo)
