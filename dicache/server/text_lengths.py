"""Prompt lengths met after the server is ready, between requests (`--prepare-text-lengths background`).

Meeting a prompt length once (`Krea2Pipeline.prepare_text_lengths`) saves a request of that length, or of any length
sharing its attention plan, the plan's first-call set-up (cuDNN's: 38-40 ms on an H100, 50-75 ms on an H200). With a
plan per length meeting all of them takes about 22 s at 1024², a third of a start-up with a compile artifact; with
shared plans (`dicache.models.krea2.attention_plans`) the server hands this class one length per plan the warm-up did
not meet, often none. In the background the server answers at once and the lengths are met in small chunks while it
has nothing else to do: a request never waits for more than one chunk, and a request whose length is not met yet has
it met on the denoise thread while its prompt is encoded (`claim`), ahead of its own denoising.

`TextLengthPreparation` is plain Python on callables: `prepare(chunk)` runs one chunk of lengths (where the requests
will meet them: the server's denoise thread), `busy()` says whether a generation is in flight. Contract:
- the lengths are met longest first (`Krea2Transformer.prepare_text_lengths` says why), each exactly once, in
  chunks of at most `chunk`;
- a chunk starts only when `busy()` is false, checked just before it starts, and has been false for `idle_s`
  (asked every `idle_poll_s`; the first wait counts from `start()`): the lengths fill lulls in the traffic, and the
  requests that follow the server's ready, or each other closely, find no chunk in flight;
- `claim(lengths)` returns those of `lengths` neither met nor claimed yet and marks them claimed: the caller meets
  them (the backend, ahead of the request that needs them) and the thread skips them;
- `close()` stops it after the chunk in flight (the server's shutdown); an error of `prepare` ends it, is logged
  once and is shown by `progress()`; the server keeps serving;
- `progress()` is what `/v1/server_info` "startup" "text_lengths" shows: lengths done (in chunks, or claimed) and
  total, those claimed ahead of a request, seconds spent in chunks, state (`running`, `done`, `stopped`, `failed`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

log = logging.getLogger("dicache.server")

IDLE_S = 2.0
"""Seconds without a generation in flight before a chunk starts (from ready for the first chunk): a server that has
just become ready is sent requests at once, and a chunk in flight made the first of them 10-27 % slower."""

CHUNK_LENGTHS = 1
"""Lengths per chunk: 50-75 ms of work on an H200 at 1024², the longest a request that arrives while one runs waits
for it (a chunk of two left the first request after ready 10-27 % slower than the steady state on an H100)."""


class TextLengthPreparation:
    """Meets `lengths` on a daemon thread, chunk by chunk, while the server is idle (see the module docstring)."""

    def __init__(
        self,
        prepare: Callable[[Sequence[int]], Any],
        lengths: Iterable[int],
        busy: Callable[[], bool],
        *,
        chunk: int = CHUNK_LENGTHS,
        idle_s: float = IDLE_S,
        idle_poll_s: float = 0.05,
        on_done: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"TextLengthPreparation: chunk={chunk!r} must be >= 1")
        self.lengths = sorted(set(lengths), reverse=True)
        self._all = frozenset(self.lengths)
        self._prepare, self._busy, self.chunk = prepare, busy, chunk
        self.idle_s, self.idle_poll_s = idle_s, idle_poll_s
        self._on_done = on_done
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._done, self._seconds, self._state, self._error = 0, 0.0, "running", None
        self._taken: set[int] = set()  # met by a chunk, or claimed by a request
        self._claimed = 0
        self._thread = threading.Thread(target=self._run, name="dicache-text-lengths", daemon=True)

    def start(self) -> TextLengthPreparation:
        self._thread.start()
        return self

    def claim(self, lengths: Iterable[int]) -> list[int]:
        """Those of `lengths` that are prompt lengths neither met nor claimed yet, now claimed (the caller meets them;
        the thread skips them); [] once the preparation has ended."""
        with self._lock:
            if self._state != "running":
                return []
            wanted = [n for n in dict.fromkeys(lengths) if n in self._all and n not in self._taken]
            self._taken.update(wanted)
            self._done += len(wanted)
            self._claimed += len(wanted)
        return wanted

    def _next_chunk(self) -> list[int]:
        """The next (longest) lengths neither met nor claimed, now taken; [] when none is left."""
        with self._lock:
            part = [n for n in self.lengths if n not in self._taken][: self.chunk]
            self._taken.update(part)
        return part

    def _wait_for_a_lull(self, quiet_since: float | None) -> float | None:
        """Wait until `busy()` has been false for `idle_s` (`quiet_since`: when it was last seen turning false, None
        while busy) or the thread is stopped; returns the new `quiet_since`."""
        while not self._stop.is_set():
            now = time.monotonic()
            if self._busy():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            if quiet_since is not None and now - quiet_since >= self.idle_s:
                break
            self._stop.wait(self.idle_poll_s)
        return quiet_since

    def _run(self) -> None:
        quiet_since: float | None = time.monotonic()
        try:
            while True:
                quiet_since = self._wait_for_a_lull(quiet_since)
                if self._stop.is_set():
                    self._finish("stopped")
                    return
                part = self._next_chunk()
                if not part:
                    break
                started = time.perf_counter()
                self._prepare(part)
                with self._lock:
                    self._done += len(part)
                    self._seconds += time.perf_counter() - started
        except Exception as exc:  # the server keeps serving: a length not met costs only its own first call
            log.exception("preparing prompt lengths in the background failed; the remaining lengths are met on demand")
            self._error = f"{type(exc).__name__}: {exc}"
            self._finish("failed")
            return
        self._finish("done")

    def _finish(self, state: str) -> None:
        with self._lock:
            self._state = state
        if self._on_done is not None:
            self._on_done(self.progress())

    def progress(self) -> dict[str, Any]:
        with self._lock:
            report = {
                "lengths": self._done,
                "of": len(self.lengths),
                "ahead_of_requests": self._claimed,
                "seconds": round(self._seconds, 2),
                "state": self._state,
            }
        if self._error is not None:
            report["error"] = self._error
        return report

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the thread ends; whether it did within `timeout`."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float | None = None) -> None:
        """Stop after the chunk in flight and wait for the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
