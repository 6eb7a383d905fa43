"""The hook layer: the only code that touches `nn.Module`s.

`BlockStackRunner` runs a block stack as Fn / middle / Bn (docs/architecture.md §2): it runs the first Fn blocks, asks
the request's policy whether the middle can be skipped, and either runs the middle blocks (storing the residuals) or
adds the calibrator's estimate of the middle residual, then runs the last Bn blocks.

`install` attaches a runner to a model described by a `ModelSpec`, in one of two ways, both reversible:
- seam: the model runs its stack through a method (`run_blocks`); the runner replaces it on the instance;
- iteration: the stack's `ModuleList` yields the runner in place of its blocks while a transformer call is active,
  so a model looping `for block in blocks: x = block(x, ...)` calls the runner once per forward.
Blocks themselves are never modified, so their own hooks and `torch.compile` keep working. The owner's forward is
wrapped to give each call its (step, branch): declared by the pipeline, or derived from the timestep.
A model split over processes carries a `ReductionLayout` (`parallel_layout`); the diff is then reduced over its group.

The block plan is the seam between caching and memory (docs/architecture.md §9): before a call runs blocks, the runner
tells every `BlockObserver` of the stack (`observe_blocks`, e.g. the layerwise offloader) which blocks it will run, in
order, and which blocks later calls will run as far as the policy already knows; then it reports each block's start and
end. A model with observers but no cache gets a runner too (every call runs all blocks). Policies never see the
observers, and observers never see the policies."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .adapters.base import ModelSpec, Streams
from .errors import UnsupportedModelError
from .policies import StepContext
from .policies.lookahead import BranchCounters, decide_without_diff, upcoming_decisions
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


@dataclass(frozen=True)
class BlockPlan:
    """The blocks a transformer call runs, published before they run.

    blocks: this call's blocks known so far, in run order (indices into the stack).
    complete: True when `blocks` is the whole call; False when more follow once the cache has decided (after the
        Fn blocks), in which case a second plan with the whole call follows before they run.
    upcoming: the blocks later calls will run, in run order (their plans joined), as far as they are known now; with
        `complete=False` they come after this call's unknown remainder. May repeat indices (one entry per run).
    """

    blocks: tuple[int, ...]
    complete: bool
    upcoming: tuple[int, ...] = ()


@dataclass(frozen=True)
class CallInfo:
    """Which call of a request is starting: its step and branch when the cache engine knows them (else None)."""

    step: int | None = None
    branch: str | None = None


class BlockObserver(Protocol):
    """Told about every call of a block stack: `begin_call`, one or two `plan`s, `before_block`/`after_block` around
    each block, `end_call` (always, also after an error). Calls arrive in that order, from the thread running the
    call; they must not synchronise with the device."""

    def begin_call(self, info: CallInfo) -> None: ...

    def plan(self, plan: BlockPlan) -> None: ...

    def before_block(self, index: int) -> None: ...

    def after_block(self, index: int) -> None: ...

    def end_call(self) -> None: ...


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
                _publish(observers, BlockPlan(everything, True, everything))
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
            _publish(observers, BlockPlan(known, early is not None, self._upcoming(ctx, early and early.cache)))
        hf = self._run(range(fn), h0, rest, kw, observers)
        decision = early if early is not None else policy.decide(step_ctx, diff)
        if observers and early is None:
            full = self._call_plan(decision.cache, fn, bn, request.segments)
            _publish(observers, BlockPlan(full, True, self._upcoming(ctx, decision.cache)))

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
            if getattr(policy, "uses_diff", True):
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


def _publish(observers: tuple, plan: BlockPlan) -> None:
    for observer in observers:
        observer.plan(plan)


class _StackIteration:
    """Mixin for a hooked `ModuleList`: while a call is active, iterating yields the runner instead of the blocks."""

    def __iter__(self):
        runner = self.__dict__.get("_dicache_runner")
        if runner is not None and runner.session is not None and runner.session.current_call() is not None:
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


@dataclass
class _Attachment:
    """The one runner of a model's stack, shared by its cache session and its observers; `undo` takes it out."""

    runner: BlockStackRunner
    undo: list[Callable[[], None]]


_ATTACHMENTS: weakref.WeakKeyDictionary[nn.Module, _Attachment] = weakref.WeakKeyDictionary()


def _attach(spec: ModelSpec) -> BlockStackRunner:
    """The runner of `spec.owner`'s stack, put in place (seam or iteration) on first use."""
    owner, blocks = spec.owner, spec.blocks
    attachment = _ATTACHMENTS.get(owner)
    if attachment is not None:
        return attachment.runner
    undo: list[Callable[[], None]] = []
    if spec.seam is not None:
        runner = BlockStackRunner(spec, plain=getattr(owner, spec.seam))
        _set_instance_attr(owner, spec.seam, runner, undo)
    else:

        def plain(*args: Any, **kwargs: Any) -> Any:
            streams, rest, kw = spec.form.split(args, kwargs)
            for block in nn.ModuleList.__iter__(blocks):
                streams = spec.form.call(block, streams, rest, kw)
            return spec.form.join(streams)

        runner = BlockStackRunner(spec, plain=plain)
        base = type(blocks)
        blocks.__class__ = _iteration_class(base)
        blocks.__dict__["_dicache_runner"] = runner

        def restore_iteration() -> None:
            blocks.__class__ = base
            blocks.__dict__.pop("_dicache_runner", None)

        undo.append(restore_iteration)
    _ATTACHMENTS[owner] = _Attachment(runner, undo)
    return runner


def _detach_if_unused(owner: nn.Module) -> None:
    attachment = _ATTACHMENTS.get(owner)
    if attachment is None or attachment.runner.session is not None or attachment.runner.observers:
        return
    del _ATTACHMENTS[owner]
    while attachment.undo:
        attachment.undo.pop()()


def observe_blocks(spec: ModelSpec, observer: BlockObserver) -> Callable[[], None]:
    """Tell `observer` about every call of `spec`'s stack, with or without caching; returns the function that stops
    it (and takes the runner out when nothing else uses it). Needs a model with a block-stack seam (`run_blocks`)."""
    if spec.seam is None:
        raise UnsupportedModelError(
            f"{type(spec.owner).__name__} runs its blocks without a block-stack seam (a `run_blocks` method); block "
            "observers such as layerwise offload need one (dicache's native Krea-2 transformer has it)"
        )
    runner = _attach(spec)
    runner.observers.append(observer)

    def stop() -> None:
        if observer in runner.observers:
            runner.observers.remove(observer)
        _detach_if_unused(spec.owner)

    return stop


def install(spec: ModelSpec, session: CacheSession) -> InstalledHooks:
    """Attach a `BlockStackRunner` serving `session` and a call-deriving forward wrapper to `spec.owner`."""
    owner = spec.owner
    runner = _attach(spec)
    if runner.session is not None:
        raise RuntimeError(f"dicache: {type(owner).__name__} already has cache hooks; remove them first")
    runner.session = session
    undo: list[Callable[[], None]] = []

    def release_runner() -> None:
        runner.session = None
        _detach_if_unused(owner)

    undo.append(release_runner)
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
    return InstalledHooks(undo)
