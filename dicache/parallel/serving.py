"""Serving one model split over several processes: rank 0 answers HTTP, every rank runs each generation in lockstep.

A model-parallel generation is a sequence of collectives, so every process must run the same requests in the same
order. `lockstep(backend, ctx)` is called on every process after the backend is loaded and parallelized:

- rank 0 gets a `LockstepBackend`: before each generation it broadcasts the request (a `GenerationSpec`, whose
  seed is already fixed) to the other ranks; generations run one at a time;
- every other rank runs the follower loop inside `lockstep` (receive a request, generate, repeat) and gets None
  back once rank 0's backend is closed.

Abandoned requests stop on every rank at the same transformer call: at each call rank 0's `should_stop()` answer is
broadcast. Control messages travel on a separate gloo group without a practical timeout, so followers may wait
for requests indefinitely (an NCCL collective would be killed by its watchdog).
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .context import ParallelContext

log = logging.getLogger(__name__)

_STOP = "stop"
_GENERATE = "generate"
_FOREVER = datetime.timedelta(days=3650)


class _Control:
    """Rank 0 -> all messages on a CPU (gloo) group."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.group = dist.new_group(backend="gloo", timeout=_FOREVER)

    def send(self, message: Any = None) -> Any:
        return self.ctx.broadcast_object(message, group=self.group)

    def flag(self, value: bool = False) -> bool:
        """Rank 0's `value` on every rank."""
        box = torch.tensor([int(value) if self.ctx.rank == 0 else 0], dtype=torch.int32)
        dist.broadcast(box, src=0, group=self.group)
        return bool(box.item())


class LockstepBackend:
    """Rank 0's backend: `generate` first tells the other ranks what to run. Other attributes pass through."""

    def __init__(self, backend: Any, control: _Control) -> None:
        self._backend, self._control = backend, control
        self._lock = threading.Lock()
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def generate(self, spec: Any, should_stop: Callable[[], bool] | None = None) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("the parallel backend is closed")
            self._control.send((_GENERATE, spec))
            local = should_stop or (lambda: False)
            return self._backend.generate(spec, should_stop=lambda: self._control.flag(local()))

    def close(self) -> None:
        """Release the followers (their `lockstep` call returns) and close the backend."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._control.send((_STOP, None))
        self._backend.close()


def follow(backend: Any, control: _Control) -> None:
    """The loop of a rank other than 0: run what rank 0 runs until it closes."""
    while True:
        kind, spec = control.send()
        if kind == _STOP:
            backend.close()
            return
        try:
            backend.generate(spec, should_stop=control.flag)
        except Exception as exc:  # rank 0 meets the same error and reports it; keep serving
            log.warning("rank %d: generation ended with %s: %s", control.ctx.rank, type(exc).__name__, exc)


def lockstep(backend: Any, ctx: ParallelContext) -> LockstepBackend | Any | None:
    """Call on every process. Single process: `backend` unchanged. Rank 0: a `LockstepBackend` to serve with (close
    it at shutdown). Other ranks: serve as followers until rank 0 closes, then return None."""
    if not ctx.enabled:
        return backend
    control = _Control(ctx)
    if ctx.rank == 0:
        return LockstepBackend(backend, control)
    follow(backend, control)
    return None
