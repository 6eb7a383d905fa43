"""Request and call bookkeeping for one cache-enabled model, kept in `contextvars` (never module globals).

A *request* is one generation (a pipeline call); a *call* is one transformer forward of one branch at one step.
Pipelines we control declare both explicitly (`request()`, `call()`); otherwise `derive_call()` maps the timestep
of each forward to (step, branch) with `StepTracker`. Concurrent requests (threads, asyncio tasks) each see their
own state because it lives in context variables.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..settings.cache_config import CacheConfig
from .state import BranchState, RequestState, branch_name
from .stats import RequestStats

_ids = itertools.count()


@dataclass
class CallContext:
    """The (request, branch, step) one transformer forward belongs to."""

    request: RequestState
    branch: BranchState
    step: int
    sigma: float | None
    explicit: bool


class CacheSession:
    """Everything `dicache.enable` attaches to one model, except the hooks themselves.

    Args:
        config: the base settings: requests that bring no config of their own run with them.
        num_blocks: blocks in the hooked stack (over all its block lists).
        boundaries: stack indices where a block list other than the first begins.
    """

    def __init__(self, config: CacheConfig, num_blocks: int, boundaries: tuple[int, ...] = ()) -> None:
        self.num_blocks = num_blocks
        self.boundaries = tuple(boundaries)
        self.configure(config)
        uid = next(_ids)
        self._request: contextvars.ContextVar[RequestState | None] = contextvars.ContextVar(
            f"dicache_request_{uid}", default=None
        )
        self._call: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
            f"dicache_call_{uid}", default=None
        )
        self._last_local: contextvars.ContextVar[RequestStats | None] = contextvars.ContextVar(
            f"dicache_last_{uid}", default=None
        )
        self.last_stats: RequestStats | None = None

    def __reduce__(self):
        raise TypeError(
            "dicache: a cache-enabled model cannot be copied or pickled; call dicache.disable(model) first "
            "and enable the copy separately"
        )

    # ------------------------------------------------------------------ settings
    def fit(self, config: CacheConfig) -> CacheConfig:
        """`config`, once it is known to fit this model's stack (`check_block_split`; else `BlockSplitError`): the
        engine's one check, on the base settings (`configure`) and on a request's own (`dicache.request`). The server
        checks at its edge instead (`server.generation.resolve`, a 400 before queueing) and passes the result on."""
        config.check_block_split(self.num_blocks)
        return config

    def configure(self, config: CacheConfig) -> None:
        """Make `config`, with caching on, the base settings: an explicit `dicache.enable` always caches (the
        field's value only tells the CLI and the server their default); a request turns caching off with its own
        config."""
        self.fit(config)
        self.config = config if config.enable_cache else config.merged({"enable_cache": True})

    # ------------------------------------------------------------------ requests
    def active_request(self) -> RequestState | None:
        return self._request.get()

    def new_request(
        self, num_steps: int | None = None, sigmas: list[float] | None = None, config: CacheConfig | None = None
    ) -> RequestState:
        """A fresh `RequestState` running `config` (already `fit`; None: the base settings)."""
        return RequestState(
            config=config or self.config,
            num_blocks=self.num_blocks,
            boundaries=self.boundaries,
            num_steps=num_steps,
            sigmas=sigmas,
        )

    @contextmanager
    def request(
        self,
        num_steps: int | None = None,
        sigmas: list[float] | None = None,
        config: CacheConfig | None = None,
        key_source: Callable[[], float] | None = None,
    ) -> Iterator[RequestState]:
        """Scope one request running `config` (already `fit`; None: the base settings). Inside an already open
        explicit request (e.g. the server's), refine that one instead; an open implicit request ends here."""
        outer = self._request.get()
        if outer is not None and outer.explicit:
            if num_steps is not None or sigmas is not None:
                outer.set_schedule(num_steps, sigmas)
            previous_source = outer.key_source
            if key_source is not None:
                outer.key_source = key_source
            try:
                yield outer
            finally:
                outer.key_source = previous_source
            return
        if outer is not None:  # an implicit request (bare forwards before this scope) ends here
            self._request.set(None)
            self._record(outer.stats)
        state = self.new_request(num_steps, sigmas, config)
        state.explicit, state.key_source = True, key_source
        token = self._request.set(state)
        try:
            yield state
        finally:
            self._request.reset(token)
            self._finish(state)

    def _finish(self, state: RequestState) -> None:
        self._record(state.stats)

    def _record(self, stats: RequestStats) -> None:
        self.last_stats = stats
        self._last_local.set(stats)

    def stats(self) -> RequestStats | None:
        """The running implicit request's stats, else the last finished request of this context, else any."""
        active = self._request.get()
        if active is not None and not active.explicit:
            return active.stats
        return self._last_local.get() or self.last_stats

    # ------------------------------------------------------------------ calls
    def current_call(self) -> CallContext | None:
        return self._call.get()

    @contextmanager
    def call(self, step: int, branch: str, sigma: float | None = None) -> Iterator[CallContext]:
        """Declare that the forwards inside belong to `branch` at `step` (for pipelines we control)."""
        request = self._request.get()
        if request is None:
            raise RuntimeError("dicache: a call scope needs an open request (use dicache.request(...))")
        ctx = CallContext(request, request.branch(branch), step, sigma, explicit=True)
        token = self._call.set(ctx)
        try:
            yield ctx
        finally:
            self._call.reset(token)

    def derive_call(self, key: float) -> contextvars.Token:
        """Open the call context of a forward whose step and branch come from its timestep `key`.

        Without an open request, an implicit one is created (bare transformer) and kept in this context until a
        higher timestep starts the next one. Returns the token for `end_call`.
        """
        request = self._request.get()
        if request is None:
            request = self.new_request()
            self._request.set(request)
        step, index, restarted = request.tracker.observe(key)
        if restarted:  # a higher timestep: the previous generation ended; keep its stats, start afresh
            self._record(request.restart())
            step, index, _ = request.tracker.observe(key)
        ctx = CallContext(request, request.branch(branch_name(index)), step, key, explicit=False)
        return self._call.set(ctx)

    def end_call(self, token: contextvars.Token) -> None:
        self._call.reset(token)
