"""Prompt lengths met after the server is ready, between requests (`--prepare-text-lengths background`).

Meeting every prompt length once (`Krea2Pipeline.prepare_text_lengths`) saves a request its length's first-call
set-up (cuDNN's attention plan: 50-75 ms on an H200), but meeting all of them takes about 22 s at 1024², a third of a
start-up with a compile artifact. In the background the server answers at once and the lengths are met in small
chunks while it has nothing else to do: a request never waits for more than one chunk, and a request whose length
is not met yet has it met on the denoise thread while its prompt is encoded (`claim`), ahead of its own denoising.

`TextLengthPreparation` is plain Python on callables: `prepare(chunk)` runs one chunk of lengths (where the requests
will meet them: the server's denoise thread), `busy()` says whether a generation is in flight. Contract:
- the lengths are met longest first (`Krea2Transformer.prepare_text_lengths` says why), each exactly once, in
  chunks of at most `chunk`;
- a chunk starts only when `busy()` is false, checked just before it starts; while busy, the thread waits
  `idle_poll_s` and asks again;
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
        idle_poll_s: float = 0.05,
        on_done: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"TextLengthPreparation: chunk={chunk!r} must be >= 1")
        self.lengths = sorted(set(lengths), reverse=True)
        self._all = frozenset(self.lengths)
        self._prepare, self._busy, self.chunk, self.idle_poll_s = prepare, busy, chunk, idle_poll_s
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

    def _run(self) -> None:
        try:
            while True:
                while self._busy():
                    if self._stop.wait(self.idle_poll_s):
                        break
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
