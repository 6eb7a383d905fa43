"""Graceful drain of a Ray Serve deployment: SIGTERM to `dicache serve --ray` drains every replica like the
single-process server, before Serve removes the application.

Serve itself removes an application's route before stopping its replicas, so clients arriving during a plain
`serve.delete` get Serve's 404. Instead the driver (`dicache serve --ray`) owns one `DrainBoard` actor (named
`board_name(app)`, namespace `NAMESPACE`, gone with the driver). Each replica follows it (`follow`, a task on the
replica's event loop, every `POLL_S`): it reports whether its drain is done and learns whether to drain. On SIGTERM
the driver begins the drain (`begin_drain`, which waits until every live replica says it drains); each then runs
its app's own `Drain` (the code path of the single-process SIGTERM: new requests and `/health` get 503 +
`Retry-After`, accepted generations get `--drain-timeout` seconds, the rest are answered 503). The driver waits
(`wait_drained`) until every replica that reported in the last `ttl_s` seconds is done, or the deadline passes, and
only then deletes the application. A second signal calls `hurry()`: every replica ends its grace period at once.

Without a board (`serve run ...:app_builder`: no driver of ours) replicas do not follow one and serve as usual; a
board that cannot be reached (driver gone) is retried now and then, never blocking the replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("dicache.server.ray")

POLL_S = 0.25
REPORT_TTL_S = 3.0
"""A replica that has not reported for this long (dead, or stopped) is not waited for."""
RETRY_S = 2.0
CALL_TIMEOUT_S = 5.0


def board_name(app_name: str) -> str:
    return f"dicache-drain-{app_name}"


class DrainBoard:
    """The drain flags and each replica's latest report (run as a Ray actor; plain Python, testable without Ray)."""

    def __init__(self, ttl_s: float = REPORT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self._clock = ttl_s, clock
        self.draining = self.hurried = False
        self._reports: dict[str, tuple[float, bool, int, bool]] = {}  # replica -> (when, done, in flight, draining)

    def report(self, replica: str, done: bool, in_flight: int = 0, draining: bool = False) -> tuple[bool, bool]:
        """Record `replica`'s state (`draining`: its own drain has begun); returns (drain, hurry) for it."""
        self._reports[replica] = (self._clock(), bool(done), int(in_flight), bool(draining or done))
        return self.draining, self.hurried

    def begin(self) -> None:
        self.draining = True

    def hurry(self) -> None:
        self.begin()
        self.hurried = True

    def unaware(self) -> list[str]:
        """Live replicas (reported within `ttl_s`) whose own drain has not begun yet."""
        now = self._clock()
        return sorted(r for r, (t, _, _, draining) in self._reports.items() if now - t <= self.ttl_s and not draining)

    def pending(self) -> dict[str, int]:
        """Replicas that reported within `ttl_s` and are not done draining -> their requests in flight."""
        now = self._clock()
        return {r: n for r, (t, done, n, _) in self._reports.items() if now - t <= self.ttl_s and not done}


def start_board(name: str, namespace: str) -> Any:
    """Driver side: the `DrainBoard` actor (owned by the calling driver, so it goes with it), or None (logged) when
    it cannot be created."""
    import ray  # the ray extra: `DrainBoard` itself is plain Python

    try:
        return ray.remote(DrainBoard).options(name=name, namespace=namespace, num_cpus=0, get_if_exists=True).remote()
    except Exception as exc:
        log.warning("no drain board (%s): on SIGTERM the replicas only get Serve's graceful shutdown", exc)
        return None


async def follow(name: str, namespace: str, replica: str, drain: Any) -> None:
    """Replica side, on the app's event loop until cancelled: report to the board `name` every `POLL_S` and start
    `drain` (the app's `Drain`) once the board says so. Never raises; an unreachable board is retried."""
    import ray  # the ray extra: `DrainBoard` itself is plain Python

    board, warned, task = None, False, None
    while True:
        try:
            if board is None:
                board = await asyncio.to_thread(ray.get_actor, name, namespace=namespace)
            busy = drain.in_flight + drain.queue.waiting
            ref = board.report.remote(replica, drain.finished, busy, drain.draining)
            draining, hurry = await asyncio.to_thread(ray.get, ref, timeout=CALL_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # no board (yet, or any more): keep serving
            board = None
            if not warned:
                log.info("replica %s: drain board %s not reachable (%s); serving on", replica, name, exc)
                warned = True
            await asyncio.sleep(RETRY_S)
            continue
        if draining and task is None:
            log.info("replica %s: the driver asked to drain", replica)
            task = asyncio.ensure_future(drain.run())  # the next report says whether it began
        if hurry:
            drain.hurry()
        await asyncio.sleep(POLL_S)


def begin_drain(board: Any, timeout_s: float = REPORT_TTL_S) -> list[str]:
    """Driver side: begin the drain on the board (a Ray actor handle) and wait, at most `timeout_s`, until every live
    replica reports that its drain began (it refuses new requests). Returns the replicas not draining in time."""
    import ray  # the ray extra: `DrainBoard` itself is plain Python

    ray.get(board.begin.remote(), timeout=CALL_TIMEOUT_S)
    deadline = time.monotonic() + timeout_s
    while unaware := ray.get(board.unaware.remote(), timeout=CALL_TIMEOUT_S):
        if time.monotonic() > deadline:
            return unaware
        time.sleep(POLL_S / 2)
    return []


def wait_drained(board: Any, deadline_s: float, hurry: Callable[[], bool], stop: Callable[[], bool]) -> dict:
    """Driver side, after `begin_drain`: wait until no replica is pending, at most `deadline_s` seconds; `hurry()`
    true -> tell the replicas to end their grace period; `stop()` true -> give up waiting. Returns the replicas
    still pending (empty after a clean drain)."""
    import ray  # the ray extra: `DrainBoard` itself is plain Python

    start, hurried = time.monotonic(), False
    pending: dict = {}
    while time.monotonic() - start < deadline_s and not stop():
        if hurry() and not hurried:
            ray.get(board.hurry.remote(), timeout=CALL_TIMEOUT_S)
            hurried = True
        pending = ray.get(board.pending.remote(), timeout=CALL_TIMEOUT_S)
        if not pending:
            return {}
        time.sleep(POLL_S)
    return pending
