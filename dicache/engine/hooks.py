"""`BlockStackRunner`: runs a transformer's block stack as Fn / middle / Bn, one block at a time (docs/architecture.md
§2).

During a transformer call the model's own loops call a `BlockProxy` in place of each block (`dicache.engine.install`
redirects the lists' iteration; a `run_blocks` seam loops over the proxies itself). The proxies hand every call to
the call's `StackWalk`, which runs the first Fn blocks, asks the request's policy whether the middle can be skipped,
and then either runs the middle blocks (storing each middle segment's residual) or answers each skipped block's call
with the segment's input plus the calibrator's estimate, without running it; the last Bn blocks always run. Because
the model's loop still runs, whatever it does between blocks keeps working by block index: SD3's skip-layer guidance
skips the blocks it names, ControlNet residuals are added after the blocks they belong to. A block that runs is
called with exactly the arguments the model gave it, so a call that caches nothing is bitwise the plain model.

The first complete call checks every block's call against its list's form (`blocks.forms.misfit`) and raises a
`BlockFormError` naming the block, the form, what it returned and the `form=` that fits. Observers of the stack
(`dicache.engine.block_plan`) are told the plan and each block's start and end; a model with observers but no cache
gets a runner too (every call runs all blocks).
"""

from __future__ import annotations

import contextvars
import copy
import inspect
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..blocks.families import registered_forms
from ..blocks.forms import DIFF_STREAMS, BlockForm, H, describe, fitting_forms, misfit
from ..blocks.stack import StackSpec
from ..errors import BlockFormError, ConfigError
from .block_plan import BlockObserver, BlockPlan, CallInfo, publish
from .cached_step import FITTER, predict, select_rows, subset_fraction, token_count
from .policies import StepContext
from .policies.lookahead import BranchCounters, decide_without_diff, upcoming_decisions
from .reduction import PARALLEL_LAYOUT_ATTR, change_ratio, relative_change
from .session import CacheSession
from .stats import RECORDER

_ids = itertools.count()


class BlockProxy:
    """Stands in for one block of the stack while a transformer call runs: the model calls it as it would call the
    block, and the call's `StackWalk` decides whether the block runs. Other attributes are the block's."""

    __slots__ = ("runner", "index", "block")

    def __init__(self, runner: BlockStackRunner, index: int, block: torch.nn.Module) -> None:
        self.runner, self.index, self.block = runner, index, block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        walk = self.runner.walk()
        if walk is None:
            return self.block(*args, **kwargs)
        return walk.block(self.index, self.block, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in BlockProxy.__slots__:  # not set yet (a copy in progress): never recurse
            raise AttributeError(name)
        return getattr(self.block, name)

    def __repr__(self) -> str:
        return f"BlockProxy({self.runner.spec.where(self.index)})"


class _Scope:
    """One transformer call in progress; its walk starts at the first block the model calls."""

    __slots__ = ("walk",)

    def __init__(self) -> None:
        self.walk: StackWalk | None = None


def step_context(ctx) -> StepContext:
    """What the policy reads of a call: its step and its branch's counters."""
    request, branch = ctx.request, ctx.branch
    return StepContext(
        step=ctx.step,
        num_steps=request.num_steps,
        cached_total=branch.cached_total,
        continuous_cached=branch.continuous_cached,
        has_residual=branch.has_residual,
        has_reference=branch.reference is not None,
        sigma=ctx.sigma,
        accumulated=branch.accumulated,
        rate=branch.rate,
    )


def count_decision(branch, decision) -> None:
    """Advance a branch's counters past a call decided `decision`."""
    if decision.cache:
        branch.cached_total += 1
        branch.continuous_cached += 1
        branch.accumulated = decision.accumulated or 0.0
    else:
        branch.continuous_cached = 0
        branch.accumulated = 0.0


def forward_sample(args: tuple, kwargs: dict) -> torch.Tensor:
    """The forward's latent input (`hidden_states`, keyword or first positional): `(B, N, C)`, what the fitted
    predictor reads; a `ConfigError` for any other input."""
    x = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(x, torch.Tensor) or x.ndim != 3:
        raise ConfigError(
            "cached_step_method='fitted' needs a transformer whose forward takes hidden_states as (batch, tokens, "
            f"channels); got {describe(x)}"
        )
    return x


def output_sample(output: Any) -> torch.Tensor:
    """The latent-shaped tensor of a forward's output: the output itself, its first element (a tuple), or `.sample`."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    sample = getattr(output, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    raise ConfigError(
        "cached_step_method='fitted' needs a transformer whose forward returns a tensor, a tuple starting with one, "
        f"or an object with .sample; got {describe(output)}"
    )


def with_sample(template: Any, sample: torch.Tensor) -> Any:
    """`template` (a computed call's output) with its sample replaced by `sample`, in the same structure."""
    if isinstance(template, torch.Tensor):
        return sample
    if isinstance(template, tuple | list):
        return type(template)([sample, *template[1:]])
    answer = copy.copy(template)
    answer.sample = sample
    return answer


class OutputCall:
    """One transformer call of a request whose cached calls the fitted output predictor answers: `answer` is the
    predicted output (no forward runs), or None for a computed call, whose output `computed` records."""

    __slots__ = ("branch", "x", "answer")

    def __init__(self, branch, x: torch.Tensor, answer: Any = None) -> None:
        self.branch, self.x, self.answer = branch, x, answer

    def computed(self, output: Any) -> None:
        """The forward returned `output`: keep its input and output for the predictions that follow."""
        calls = self.branch.computed_calls
        calls.record(self.x, output_sample(output))
        calls.template = output


class TokenKeys:
    """What a block's attention gets in place of its key mask under `cached_step_method=tokens` (through the
    block's `attention_mask` argument, which it hands to `attn.kernel` unchanged; `KernelTap` reads it).

    Recording (`keys` None, a computed call): the kernel's keys and values are kept here, the attention is the
    plain one. Subset (a cached call computing `rows` only): the kernel's keys and values (those rows') replace
    `rows` of the kept ones, and the queries attend to all of them. Layout `(B, heads, seq, head_dim)`."""

    __slots__ = ("mask", "keys", "values", "rows")

    def __init__(self, mask: Any, keys: Any = None, values: Any = None, rows: Any = None) -> None:
        self.mask, self.keys, self.values, self.rows = mask, keys, values, rows

    def attend(self, kernel: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if self.keys is None:
            self.keys, self.values = k, v
            return kernel(q, k, v, self.mask)
        keys = self.keys.index_copy(2, self.rows, k)
        values = self.values.index_copy(2, self.rows, v)
        return kernel(q, keys, values, self.mask)


class KernelTap:
    """Stands in for an attention module's `kernel` (set by `engine/install.py` when a request first computes token
    subsets): the module's own kernel, except when a `TokenKeys` comes as the key mask."""

    __slots__ = ("inner",)

    def __init__(self, inner: Callable[..., torch.Tensor]) -> None:
        self.inner = inner

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Any = None) -> torch.Tensor:
        if isinstance(key_mask, TokenKeys):
            return key_mask.attend(self.inner, q, k, v)
        return self.inner(q, k, v, key_mask)


class BlockStackRunner:
    """Runs a block stack for the call context the session reports, and keeps the stack's observers informed.

    Args:
        spec: the transformer's block lists and forms.
        plain: runs the whole stack without the runner (the model's own `run_blocks`), for seam models when nothing
            needs the runner; None for models whose loops the iteration redirect reaches.
        session: request/call bookkeeping of the cache (None: no caching; every call runs all blocks).
    """

    def __init__(self, spec: StackSpec, plain: Callable[..., Any] | None = None, session: CacheSession | None = None):
        self.session = session
        self.spec = spec
        self.plain = plain
        self.observers: list[BlockObserver] = []
        self.proxies = tuple(BlockProxy(self, i, block) for i, block in enumerate(spec.blocks))
        self.checked: set[int] = set()
        """Lists (positions in `spec.lists`) whose form a complete call has confirmed."""
        self.tap_kernels: Callable[[], None] | None = None
        """Puts a `KernelTap` on every block's attention kernel (given by `engine/install.py` when every block has
        an `attn.kernel`; None: token subsets are not supported)."""
        self.kernels_tapped = False
        self.costs: dict[int, tuple[float, int]] = {}
        """Per block: multiply-adds per row of its linears and its attention's query width (token subsets' cost)."""
        self._scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
            f"dicache_stack_{next(_ids)}", default=None
        )

    # ------------------------------------------------------------------ calls
    def active(self) -> bool:
        """Whether a transformer call is in progress in this context (the lists then yield the proxies)."""
        return self._scope.get() is not None

    @contextmanager
    def scope(self) -> Iterator[None]:
        """One transformer call: the blocks the model calls inside form one walk through the stack."""
        scope = _Scope()
        token = self._scope.set(scope)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            self._scope.reset(token)
            if scope.walk is not None:
                scope.walk.finish(failed)
            elif not failed and len(self.checked) < len(self.spec.lists):
                raise BlockFormError(self._no_block_ran())

    def walk(self) -> StackWalk | None:
        """The walk of the call in progress (started by its first block), or None outside a call."""
        scope = self._scope.get()
        if scope is None:
            return None
        if scope.walk is None:
            ctx = self.session.current_call() if self.session is not None else None
            scope.walk = StackWalk(self, ctx, tuple(self.observers))
        return scope.walk

    def output_call(self, args: tuple, kwargs: dict) -> OutputCall | None:
        """For a request under the fitted output predictor (`cached_step_method=fitted`): the call's answer when its
        step mask caches it (counted, recorded and told to the observers as a call that runs no block), else an
        `OutputCall` that records the computed output. None for any other call."""
        ctx = self.session.current_call() if self.session is not None else None
        if ctx is None or not ctx.request.predicts_output:
            return None
        request, branch = ctx.request, ctx.branch
        x = forward_sample(args, kwargs)
        decision = decide_without_diff(request.policy, step_context(ctx))
        if decision is None or not decision.cache:
            return OutputCall(branch, x)
        calls = branch.computed_calls
        features = calls.features(x)
        weights = request.fitted_weights()
        if weights is not None:
            weight = weights.weight(ctx.step, branch.name, features.device)
        else:
            fitter = FITTER.get()
            if fitter is None:
                raise ConfigError(
                    "cached_step_method='fitted' needs fitted_predictor (SGLANG_CACHE_DIT_FITTED_PREDICTOR): the "
                    "predictor file dicache calibrate writes next to its profile"
                )
            calls_by_branch = {name: b.computed_calls for name, b in request.branches.items()}
            weight = fitter.weights(ctx.step, branch.name, x, features, calls_by_branch)
        template = calls.template
        answer = with_sample(template, predict(features, weight, output_sample(template).dtype))
        count_decision(branch, decision)
        branch.stats.record(ctx.step, True, decision.reason, None)
        observers = tuple(self.observers)
        for observer in observers:
            observer.begin_call(CallInfo(ctx.step, branch.name))
        try:
            publish(observers, BlockPlan((), True, self.upcoming(ctx, True)))
        finally:
            for observer in reversed(observers):
                observer.end_call()
        return OutputCall(branch, x, answer)

    def run_seam(self, *args: Any, **kwargs: Any) -> Any:
        """Replaces the owner's `run_blocks(hidden, *block_args)` seam: the blocks in order, each through its proxy."""
        if (self.session is None or self.session.current_call() is None) and not self.observers:
            return self.plain(*args, **kwargs)
        form = self.spec.lists[0].form
        values, taken = form.read_inputs(args, kwargs)
        result = None
        with self.scope():
            for proxy in self.proxies:
                call_args, call_kwargs = form.rebuild_call(values, taken, args, kwargs)
                result = proxy(*call_args, **call_kwargs)
                values.update(form.read_outputs(result))  # the walk has checked the structure
        return result

    def _no_block_ran(self) -> str:
        owner = type(self.spec.owner).__name__
        paths = ", ".join(block_list.path for block_list in self.spec.lists)
        return (
            f"dicache: {owner}.forward ran none of its blocks through {paths} (it does not loop over that list in "
            f"the usual `for block in self.<list>` way), so caching would do nothing; this model needs a family "
            "entry naming the lists its forward loops over (dicache.blocks.families)"
        )

    # ------------------------------------------------------------------ plans
    def call_plan(self, cache: bool, fn: int, bn: int, segments: Sequence = ()) -> tuple[int, ...]:
        """All blocks on a computed call; on a cached one the Fn blocks, the middle blocks it still computes (the
        uncached `segments`, i.e. `cached_step_blocks`), then the Bn blocks."""
        num_blocks = self.spec.num_blocks
        if not cache:
            return tuple(range(num_blocks))
        kept = tuple(b for seg in segments if not seg.cached for b in range(seg.start, seg.stop))
        return tuple(range(fn)) + kept + tuple(range(num_blocks - bn, num_blocks))

    def upcoming(self, ctx, current_cache: bool | None) -> tuple[int, ...]:
        """The blocks of the calls after this one, as far as the policy knows them: at least one stack's worth when
        it can (a static mask knows the whole request); an undecided call contributes its Fn blocks and ends the list.
        """
        request = ctx.request
        config = request.config
        fn, bn, num_blocks = config.Fn_compute_blocks, config.Bn_compute_blocks, self.spec.num_blocks
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
            upcoming.extend(self.call_plan(call.cache, fn, bn, request.segments))
            if len(upcoming) >= num_blocks:
                break
        return tuple(upcoming)


class StackWalk:
    """One transformer call's way through the stack, driven by the blocks the model calls (in stack order).

    `state` holds each stream as the model last handed it to a block, or as the last block returned it (for a stream
    blocks return but do not take). A middle segment's residual is what its last run block returned minus the
    stream at its first block; a skipped segment answers every one of its blocks with that input plus the estimate.
    """

    def __init__(self, runner: BlockStackRunner, ctx, observers: tuple[BlockObserver, ...]) -> None:
        self.runner, self.spec, self.ctx, self.observers = runner, runner.spec, ctx, observers
        self.enabled = ctx is not None and ctx.request.enabled
        self.checking = len(runner.checked) < len(self.spec.lists)
        self.last = -1
        self.lists_seen: set[int] = set()
        self.state: dict[str, Any] = {}
        self.h0: tuple[torch.Tensor, ...] | None = None
        self.h0_list = -1
        self.hf: tuple[torch.Tensor, ...] | None = None  # the diff streams as the last Fn block returned them
        self.decision = None
        self.open: int | None = None  # the middle segment whose blocks are being run or skipped
        self.seg_form: BlockForm | None = None
        self.seg_in: dict[str, Any] = {}
        self.seg_out: dict[str, Any] | None = None
        self.cached_out: Any = None
        self.stack_in: tuple[torch.Tensor, ...] | None = None  # the stack's input streams (EasyCache)
        self.middle_out: tuple[torch.Tensor, ...] | None = None  # the middle's output streams, computed call
        self.fn_out: tuple[torch.Tensor, ...] | None = None  # the streams after the Fn blocks
        self.position = 0.0
        self.previous: tuple | None = None  # the last run block's call, checked again against the next call
        self.tokens = False  # cached_step_method=tokens
        self.rows: torch.Tensor | None = None  # the rows a cached call computes (tokens)
        self.h_rows: torch.Tensor | None = None  # those rows' `h` stream through the skipped blocks
        self.cached_values: dict[str, Any] = {}
        info = CallInfo(ctx.step, ctx.branch.name) if ctx is not None else CallInfo()
        for observer in observers:
            observer.begin_call(info)
        if not self.enabled:
            everything = tuple(range(self.spec.num_blocks))
            publish(observers, BlockPlan(everything, True, everything))
            return
        request = ctx.request
        config = request.config
        self.fn, self.bn = config.Fn_compute_blocks, config.Bn_compute_blocks
        self.tokens = config.cached_step_method == "tokens"
        self.segments = request.segments
        self.segment_of = request.segment_of
        self.step_ctx = step_context(ctx)
        # Rules that do not read the diff decide before any block runs (same answer: decisions are pure), so the
        # observers learn the whole call up front; otherwise they learn the Fn blocks now and the rest after them.
        self.early = decide_without_diff(request.policy, self.step_ctx) if observers else None
        if observers:
            early = self.early
            known = (
                runner.call_plan(early.cache, self.fn, self.bn, self.segments)
                if early is not None
                else tuple(range(self.fn))
            )
            publish(observers, BlockPlan(known, early is not None, runner.upcoming(ctx, early and early.cache)))

    # ------------------------------------------------------------------ one block
    def block(self, index: int, block: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """The model calls stack block `index` with `(args, kwargs)`: run it, or answer for it."""
        spec = self.spec
        if index <= self.last:
            raise BlockFormError(
                f"dicache: {spec.where(index)} was called after {spec.where(self.last)} in one transformer call: the "
                "model runs its blocks out of stack order (or twice), which a block-skipping cache cannot follow"
            )
        position = spec.list_of(index)
        form = spec.lists[position].form
        self.lists_seen.add(position)
        inputs, _ = form.read_inputs(args, kwargs)
        if self.previous is not None:
            self._check(*self.previous, following=(args, kwargs))
            self.previous = None
        for stream in form.outputs:
            if stream in inputs:
                self.state[stream] = inputs[stream]
        self.last = index
        if not self.enabled:
            return self._run(index, block, form, args, kwargs)[0]
        if self.decision is None:
            if index < self.fn:
                if position != self.h0_list:  # the Fn residual is measured within one list's streams
                    self.h0, self.h0_list = self._diff_streams(), position
                result = self._run(index, block, form, args, kwargs)[0]
                if index == self.fn - 1:  # before a next list (which may join the streams) overwrites them
                    self.hf = self._diff_streams()
                return result
            self._decide()
        segment = self.segment_of[index]
        if segment != self.open:
            self._close()
            if segment is not None:
                self._enter(segment, form)
        skipped = segment is not None and self.segments[segment].cached
        if skipped and self.decision.cache:
            self.previous = None
            return self._token_block(index, block, args, kwargs) if self.tokens else self.cached_out
        keys = None
        if skipped and self.tokens:  # a computed call keeps each skippable block's keys and values
            args, kwargs, keys = self._with_keys(block, args, kwargs, TokenKeys(None))
        result, outputs = self._run(index, block, form, args, kwargs)
        if keys is not None:
            self.ctx.branch.kv[index] = (keys.keys, keys.values)
        if segment is not None:
            self.seg_out = outputs
        return result

    # ------------------------------------------------------------------ token subsets (cached_step_method=tokens)
    def _with_keys(self, block: torch.nn.Module, args: tuple, kwargs: dict, keys: TokenKeys) -> tuple:
        """`(args, kwargs, keys)`: the block's call with `keys` as its `attention_mask` (holding the one given)."""
        self._check_tokens(block)
        runner = self.runner
        if not runner.kernels_tapped:
            runner.tap_kernels()
            runner.kernels_tapped = True
        bound = bound_call(block, args, kwargs)
        keys.mask = bound.arguments.get("attention_mask")
        bound.arguments["attention_mask"] = keys
        return bound.args, bound.kwargs, keys

    def _token_block(self, index: int, block: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """A skipped block on a cached call: run the chosen rows through it against the kept keys and values; the
        segment's last block answers with the estimate, those rows replaced by what the blocks computed."""
        branch, segment = self.ctx.branch, self.segments[self.open]
        kept = branch.kv.get(index)
        if kept is None or branch.token_input is None:
            raise RuntimeError(f"dicache: no kept keys/values for {self.spec.where(index)}; no computed call ran it")
        if self.rows is None:
            source = self.seg_in[H]
            count = token_count(source.shape[1], self.ctx.request.config.cached_step_tokens)
            self.rows = select_rows(source, branch.token_input, count)
            self.h_rows = source.index_select(1, self.rows)
        args, kwargs, _ = self._with_keys(block, args, kwargs, TokenKeys(None, *kept, self.rows))
        bound = bound_call(block, args, kwargs)
        bound.arguments["hidden_states"] = self.h_rows
        call = block.token_rows(self.rows, *bound.args, **bound.kwargs)
        for observer in self.observers:
            observer.before_block(index)
        self.h_rows = block(*call)
        for observer in self.observers:
            observer.after_block(index)
        self.ctx.request.stats.partial_blocks += self._subset_cost(index, block, self.h_rows.shape[1], kept[0])
        if index != segment.stop - 1:
            return self.cached_out
        values = dict(self.cached_values)
        values[H] = values[H].index_copy(1, self.rows, self.h_rows.to(values[H].dtype))
        self.state.update(values)
        return self.seg_form.pack(values)

    def _subset_cost(self, index: int, block: torch.nn.Module, rows: int, keys: torch.Tensor) -> float:
        cost = self.runner.costs.get(index)
        if cost is None:
            macs = sum(m.in_features * m.out_features for m in block.modules() if isinstance(m, torch.nn.Linear))
            attn = getattr(block, "attn", None)
            width = int(getattr(attn, "num_heads", 0)) * int(getattr(attn, "head_dim", 0))
            cost = self.runner.costs[index] = (float(macs), width)
        return subset_fraction(rows, keys.shape[2], *cost)

    def _run(self, index: int, block: torch.nn.Module, form: BlockForm, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        """Run the block as the model called it; its result and that result read with `form` (None: unreadable)."""
        for observer in self.observers:
            observer.before_block(index)
        result = block(*args, **kwargs)
        for observer in self.observers:
            observer.after_block(index)
        outputs = form.read_outputs(result)
        if self.checking:  # checked at the next block's call, which shows where the model puts what this returned
            self.previous = (index, block, form, args, kwargs, result, dict(self.state))
        elif outputs is None or not isinstance(outputs.get(H), torch.Tensor):
            self._check(index, block, form, args, kwargs, result, dict(self.state), following=None)
        if outputs is not None:
            self.state.update(outputs)
        return result, outputs

    def _check(self, index, block, form, args, kwargs, result, before, following) -> None:
        """Raise a `BlockFormError` when the call does not fit `form` (`following`: the next block's call)."""
        passed = form.read_inputs(*following)[0] if following is not None else None
        reason = misfit(form, args, kwargs, result, before, passed)
        if reason is None:
            return
        spec = self.spec
        fits = fitting_forms(form.names, args, kwargs, result, before, following)
        position = spec.list_of(index)
        owner = f"{spec.family} model" if spec.family != "generic" else "model (no family entry: generic path)"
        message = (
            f"dicache: {spec.where(index)} ({type(block).__name__}) does not fit the block form {form.label!r} "
            f"dicache uses for this {owner}: {reason}. It was called with {describe_call(args, kwargs)} and "
            f"returned {describe(result)}. "
        )
        registered = registered_forms(spec.owner)
        if registered is not None and registered.get(spec.lists[position].path, "") in fits:
            message += (
                f"The {spec.family} entry's form for {spec.lists[position].path} "
                f"({registered[spec.lists[position].path]!r}) fits: call dicache.enable without form=."
            )
        elif fits:
            forms = [block_list.form.label for block_list in spec.lists]
            forms[position] = fits[0]
            value = repr(fits[0]) if len(forms) == 1 else "[" + ", ".join(repr(f) for f in forms) + "]"
            others = f" (forms that fit this call: {', '.join(repr(f) for f in fits)})" if len(fits) > 1 else ""
            message += f"Pass dicache.enable(..., form={value}){others}."
        else:
            message += "None of the declared forms fits this call (dicache.adapters.FORMS)."
        raise BlockFormError(message)

    # ------------------------------------------------------------------ the cache
    def _diff_streams(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.state[s] for s in DIFF_STREAMS if isinstance(self.state.get(s), torch.Tensor))

    def _decide(self) -> None:
        ctx, runner = self.ctx, self.runner
        request, branch = ctx.request, ctx.branch
        hf = self.hf if self.hf is not None else self._diff_streams()
        h0 = self.h0 if self.h0 is not None else hf
        fn_residual: list[tuple[torch.Tensor, ...]] = []

        def residual() -> tuple[torch.Tensor, ...]:
            if not fn_residual:
                fn_residual.append(tuple(torch.sub(a, b) for a, b in zip(hf, h0)))
            return fn_residual[0]

        policy = request.policy
        signal = getattr(policy, "signal", "fn_residual")
        self.stack_in, self.fn_out = h0, hf

        def diff() -> float:
            layout = getattr(self.spec.owner, PARALLEL_LAYOUT_ATTR, None)
            if signal == "input_change":  # EasyCache: the input's change relative to the last computed output
                return change_ratio(h0, branch.previous_input, branch.computed_io[1], None, layout)
            return relative_change(residual(), branch.reference, layout)

        decision = self.early if self.early is not None else policy.decide(self.step_ctx, diff)
        if self.observers and self.early is None:
            full = runner.call_plan(decision.cache, self.fn, self.bn, self.segments)
            publish(self.observers, BlockPlan(full, True, runner.upcoming(ctx, decision.cache)))
        self.position = request.position(ctx.step, ctx.sigma)
        count_decision(branch, decision)
        if (
            policy.uses_diff
            and (not decision.cache or signal == "fn_residual_consecutive")
            and signal != "input_change"
        ):
            branch.reference = residual()
        if signal == "input_change":
            branch.previous_input = h0
        self.decision = decision

    def _enter(self, segment: int, form: BlockForm) -> None:
        """The first called block of middle segment `segment`: remember its input; on a cached call, build the answer
        every block of a skipped segment gives."""
        self.open, self.seg_form, self.seg_out = segment, form, None
        self.rows = self.h_rows = None
        self.seg_in = {s: self.state.get(s) for s in form.outputs}
        if not (self.decision.cache and self.segments[segment].cached):
            return
        branch = self.ctx.branch
        values: dict[str, Any] = {}
        for stream in form.outputs:
            if (segment, stream) in branch.none_outputs:
                values[stream] = None
                continue
            calibrator = branch.calibrators.get((segment, stream))
            if calibrator is None:
                raise RuntimeError(
                    f"dicache: no stored residual for stream {stream!r} of middle segment {segment} "
                    f"({self.spec.where(self.segments[segment].start)} on); the computed steps never ran it"
                )
            base = self.seg_in[stream]
            estimate = calibrator.estimate(self.position, base)
            values[stream] = estimate if base is None else base + estimate
        self.state.update(values)
        self.cached_values = values
        self.cached_out = form.pack(values)

    def _check_tokens(self, block: torch.nn.Module) -> None:
        """`cached_step_method=tokens` runs on blocks that declare `token_rows` and compute attention through
        `attn.kernel`, without sequence parallelism; a `ConfigError` otherwise."""
        if not hasattr(block, "token_rows") or self.runner.tap_kernels is None:
            raise ConfigError(
                "cached_step_method='tokens' needs blocks that declare token_rows and compute attention through "
                f"attn.kernel (the native Krea-2 transformer's do); {type(block).__name__} of "
                f"{type(self.spec.owner).__name__} does not: use another cached_step_method"
            )
        if getattr(getattr(self.spec.owner, PARALLEL_LAYOUT_ATTR, None), "shard", None) is not None:
            raise ConfigError("cached_step_method='tokens' does not run under Ulysses sequence parallelism")

    def _close(self) -> None:
        """Leaving the open segment: on a computed call, store what its blocks added to each stream."""
        segment, self.open = self.open, None
        if segment is None or self.decision.cache or not self.segments[segment].cached or self.seg_out is None:
            return
        if self.ctx.request.predicts_output:  # cached calls never run the walk: no residual is forecast
            self.middle_out = self._diff_streams()
            return
        if self.tokens:
            self.ctx.branch.token_input = self.seg_in.get(H)
        branch = self.ctx.branch
        for stream in self.seg_form.outputs:
            out, base = self.seg_out.get(stream), self.seg_in.get(stream)
            if out is None:
                branch.none_outputs.add((segment, stream))
                continue
            branch.none_outputs.discard((segment, stream))
            residual = out if base is None else torch.sub(out, base)
            branch.calibrator(segment, stream).update(self.position, residual, base)
        self.middle_out = self._diff_streams()

    def _computed_call(self) -> None:
        """After a computed call: EasyCache's rate from this and the last computed call, and the residual recorder
        (`stats.RECORDER`, set by `dicache calibrate`) when one listens."""
        branch = self.ctx.branch
        if getattr(self.ctx.request.policy, "signal", None) == "input_change":
            if branch.computed_io is not None:
                last_in, last_out = branch.computed_io
                layout = getattr(self.spec.owner, PARALLEL_LAYOUT_ATTR, None)
                rate = change_ratio(self.middle_out, last_out, self.stack_in, last_in, layout)
                branch.rate = rate if math.isfinite(rate) else None
            branch.computed_io = (self.stack_in, self.middle_out)
        recorder = RECORDER.get()
        if recorder is not None:
            recorder.record(branch.name, self.ctx.step, self.stack_in, self.fn_out, self.middle_out)

    def finish(self, failed: bool) -> None:
        """The transformer call returned (or failed): close the open segment, record the call, confirm the forms."""
        try:
            if failed:
                return
            if self.previous is not None:
                self._check(*self.previous, following=None)
            ctx = self.ctx
            if self.enabled and self.decision is not None:
                self._close()
                if not self.decision.cache and self.middle_out is not None:
                    self._computed_call()
                ctx.branch.stats.record(ctx.step, self.decision.cache, self.decision.reason, self.decision.diff)
            elif ctx is not None and not self.enabled:
                ctx.branch.stats.record(ctx.step, False, "disabled", None)
            if self.checking:
                self.runner.checked |= self.lists_seen
        finally:
            for observer in reversed(self.observers):
                observer.end_call()


def bound_call(block: torch.nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The block call's arguments bound to its `forward`'s parameters (defaults applied)."""
    bound = inspect.signature(block.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def describe_call(args: tuple, kwargs: dict, limit: int = 5) -> str:
    """`(Tensor[1, 16, 32], encoder_hidden_states=Tensor[1, 8, 32], …)`: a block call's arguments, briefly."""
    parts = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
    shown = parts[:limit] + (["…"] if len(parts) > limit else [])
    return "(" + ", ".join(shown) + ")"
