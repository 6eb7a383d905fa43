"""`JobQueue`: a bounded FIFO of generation jobs served by worker threads.

Contract:
- `submit` never blocks: it raises `QueueFullError` when `capacity` jobs already wait for a busy worker (running
  jobs do not count, nor jobs an idle worker is about to take, so capacity 0 means "only when a worker is free";
  `bypass_capacity` lets a health probe in anyway) and `ShuttingDownError` after `close` or `shutdown`.
- `cancel` drops a job that has not started, freeing its slot at once; for a running job it sets `job.stop`, which
  the handler may poll to end early (the generation backend checks it before every block). `job.stop_reason` says
  why ("abandoned", "shutdown").
- `close` refuses new jobs and keeps serving accepted ones; `abort` then fails every waiting job with
  `ShuttingDownError` and asks the running ones to stop.
- `shutdown(wait=True)` refuses new jobs, lets the workers finish every waiting and running job, then joins them.
- Each job runs `handler(job)` in a worker thread inside a copy of the submitter's `contextvars` context, and its
  `concurrent.futures.Future` receives the result or the exception.
"""

from __future__ import annotations

import collections
import contextvars
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class QueueFullError(Exception):
    """All waiting slots are taken."""


class ShuttingDownError(Exception):
    """The queue no longer accepts jobs."""


@dataclass(eq=False)
class Job:
    payload: Any
    future: Future = field(default_factory=Future)
    stop: threading.Event = field(default_factory=threading.Event)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    finished_at: float | None = None
    stop_reason: str | None = None

    @property
    def queued_s(self) -> float:
        return (self.started_at or time.perf_counter()) - self.submitted_at

    @property
    def run_s(self) -> float:
        if self.started_at is None:
            return 0.0
        return (self.finished_at or time.perf_counter()) - self.started_at


class JobQueue:
    """Bounded queue + `workers` threads running `handler(job)`.

    `on_change(waiting, running)` is called (under no lock) whenever either count changes, e.g. to update gauges.
    """

    def __init__(
        self,
        handler: Callable[[Job], Any],
        *,
        capacity: int,
        workers: int = 1,
        on_change: Callable[[int, int], None] | None = None,
        name: str = "dicache-worker",
    ) -> None:
        if capacity < 0 or workers < 1:
            raise ValueError(f"JobQueue: capacity={capacity} must be >= 0 and workers={workers} >= 1")
        self.handler, self.capacity, self.num_workers = handler, capacity, workers
        self._on_change, self._name = on_change, name
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: set[Job] = set()
        self._running = 0
        self._cond = threading.Condition()
        self._closing = False
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ state
    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def idle(self) -> bool:
        """No job waiting or running."""
        with self._cond:
            return not self._waiting and not self._running

    def _notify(self) -> None:
        if self._on_change is not None:
            with self._cond:
                waiting, running = len(self._waiting), self._running
            self._on_change(waiting, running)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._cond:
            if self._threads:
                return
            self._threads = [
                threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                for i in range(self.num_workers)
            ]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Refuse new jobs; accepted ones still run."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def abort(self, message: str) -> int:
        """Fail every waiting job with `ShuttingDownError(message)` and ask every running job to stop (reason
        "shutdown"); refuses new jobs from now on. Returns the number of jobs affected."""
        with self._cond:
            self._closing = True
            dropped = list(self._waiting)
            self._waiting.clear()
            running = list(self._active)
            self._cond.notify_all()
        for job in dropped:
            job.stop_reason = "shutdown"
            job.future.set_exception(ShuttingDownError(message))
        for job in running:
            job.stop_reason = job.stop_reason or "shutdown"
            job.stop.set()
        self._notify()
        return len(dropped) + len(running)

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Refuse new jobs; with `wait`, finish all accepted jobs and join the workers (up to `timeout` seconds)."""
        with self._cond:
            self._closing = True
            if not wait:
                dropped = list(self._waiting)
                self._waiting.clear()
            else:
                dropped = []
            self._cond.notify_all()
        for job in dropped:
            job.future.cancel()
        self._notify()
        if wait:
            deadline = None if timeout is None else time.monotonic() + timeout
            for thread in self._threads:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ jobs
    def submit(self, payload: Any, *, bypass_capacity: bool = False) -> Job:
        job = Job(payload)
        with self._cond:
            if self._closing:
                raise ShuttingDownError("the server is shutting down and accepts no new requests")
            idle_workers = max(0, self.num_workers - self._running)
            if len(self._waiting) >= self.capacity + idle_workers and not bypass_capacity:
                raise QueueFullError(
                    f"the request queue is full ({len(self._waiting)} waiting, {self._running} running; "
                    f"capacity {self.capacity}); retry later"
                )
            self._waiting.append(job)
            self._cond.notify()
        self._notify()
        return job

    def cancel(self, job: Job, reason: str = "abandoned") -> bool:
        """Drop `job` if it has not started (True); else ask a running job to stop early via `job.stop` (False)."""
        with self._cond:
            job.stop_reason = job.stop_reason or reason
            try:
                self._waiting.remove(job)
            except ValueError:
                job.stop.set()
                return False
        job.future.cancel()
        self._notify()
        return True

    def _next(self) -> Job | None:
        """The next job not cancelled meanwhile, marked running; None once closing and drained."""
        with self._cond:
            while True:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if not self._waiting:
                    return None
                job = self._waiting.popleft()
                if job.future.set_running_or_notify_cancel():
                    self._running += 1
                    self._active.add(job)
                    job.started_at = time.perf_counter()
                    return job

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            self._run(job)
            del job  # an idle worker keeps nothing of its last job (its result, or its exception and frames)

    def _run(self, job: Job) -> None:
        self._notify()
        try:
            result = job.context.run(self.handler, job)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
            job.finished_at = time.perf_counter()
            job.future.set_exception(exc)
        else:
            job.finished_at = time.perf_counter()
            job.future.set_result(result)
        finally:
            with self._cond:
                self._running -= 1
                self._active.discard(job)
            self._notify()
