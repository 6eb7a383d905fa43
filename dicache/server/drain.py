"""Graceful drain of one app: stop taking work, finish what was accepted within a grace period, answer the rest.

Phases (`Drain.run()`, idempotent; the app's lifespan shutdown runs it, and `dicache serve` runs it on SIGTERM while
the listener is still open, so late clients get an answer instead of "connection refused"):

1. draining: every new HTTP request except `/health` and `/metrics` is answered 503 with `Retry-After`
   (`DrainMiddleware`), `/health` answers 503 `{"status": "draining"}`, request bodies still being read are answered
   503 (`body_limit`), and the queue accepts nothing new. Accepted generations (waiting or running) continue.
2. after `grace_s` seconds (or at once after `hurry()`, e.g. a second SIGTERM): waiting generations are answered 503
   and running ones stop at their next stop point (one block) and are answered 503.
3. done once every request in flight has been answered, or `answer_timeout_s` after phase 2 began.

All methods but `hurry` run on the app's event loop; `hurry` may be called from any thread or a signal handler.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import send_error
from .jobs import JobQueue

log = logging.getLogger("dicache.server")

POLL_S = 0.05
OPEN_DURING_DRAIN = frozenset({"/health", "/metrics"})
SHUTDOWN_MESSAGE = "the server is shutting down and accepts no new requests; retry on another replica or later"
UNFINISHED_MESSAGE = "the server shut down before this request finished (drain grace period over); retry"


class Drain:
    """The shutdown state of one app (see the module docstring).

    Args:
        queue: the app's generation queue.
        grace_s: seconds accepted generations may take once the drain began (>= 0).
        answer_timeout_s: seconds to wait, after stopping the unfinished generations, for their answers to go out.
    """

    def __init__(self, queue: JobQueue, grace_s: float, answer_timeout_s: float = 10.0) -> None:
        self.queue, self.grace_s, self.answer_timeout_s = queue, grace_s, answer_timeout_s
        self.in_flight = 0  # HTTP requests being handled (those DrainMiddleware let in)
        self._began: asyncio.Event | None = None
        self._hurry = threading.Event()
        self._task: asyncio.Task | None = None
        self.unfinished = 0  # generations stopped or dropped when the grace period ended
        self.finished = False

    @property
    def draining(self) -> bool:
        return self._began is not None and self._began.is_set()

    def began_event(self) -> asyncio.Event:
        """Set once the drain begins (created on the running loop on first use)."""
        if self._began is None:
            self._began = asyncio.Event()
        return self._began

    def hurry(self) -> None:
        """End the grace period now: stop the unfinished generations (thread- and signal-safe)."""
        self._hurry.set()

    async def run(self) -> None:
        """Drain (once; later or concurrent calls wait for the same drain)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        await asyncio.shield(self._task)

    async def _run(self) -> None:
        self.began_event().set()
        self.queue.close()
        start = time.monotonic()
        log.info(
            "draining: new requests get 503; %d waiting and %d running generation(s) have %g s to finish",
            self.queue.waiting,
            self.queue.running,
            self.grace_s,
        )
        while not self._idle() and time.monotonic() - start < self.grace_s and not self._hurry.is_set():
            await asyncio.sleep(POLL_S)
        if not self.queue.idle:
            self.unfinished = self.queue.abort(UNFINISHED_MESSAGE)
            reason = "a second signal" if self._hurry.is_set() else f"the {self.grace_s:g} s grace period"
            log.warning("drain: %s ended; %d unfinished generation(s) answered 503", reason, self.unfinished)
        deadline = time.monotonic() + self.answer_timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if self.in_flight:
            log.warning("drain: %d request(s) still unanswered after %g s", self.in_flight, self.answer_timeout_s)
        self.finished = True
        log.info("drained in %.1f s", time.monotonic() - start)

    def _idle(self) -> bool:
        return self.queue.idle and self.in_flight == 0


class DrainMiddleware:
    """Counts the HTTP requests in flight for `Drain`; while draining, answers new ones 503 with `Retry-After` and
    `Connection: close` (except `/health`, which reports the drain itself, and `/metrics`)."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_DURING_DRAIN:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await send_error(send, 503, SHUTDOWN_MESSAGE, "shutting_down", close=True)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
