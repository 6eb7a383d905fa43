"""Python's garbage collector in a long-running server: the objects of start-up frozen out of its passes, and its pauses
counted.

A loaded, compiled pipeline leaves some 500 000 Python objects (modules, parameters, compiled graphs and their guards).
A full (generation 2) collection walks all of them: about 0.2 s on a 2-core CPU (`bench_server_cpu.py`), a pause that
holds the GIL, so it stalls whichever phase is launching kernels. `freeze_start_up_objects()` collects once and moves
every object alive then to the permanent generation (`gc.freeze`), which later collections skip; what requests allocate
is collected as before. `GCPauses` counts collections and their seconds per generation (`/v1/server_info` "gc"; with the
freeze, 0.7 ms per Turbo request in the full-size FP8 server, benchmarks/RESULTS.md 2026-12-03).
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


def freeze_start_up_objects() -> int:
    """Collect, then freeze every object alive (call after loading and warm-up). Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GCPauses:
    """Collections and their seconds per generation since `install()`, from `gc.callbacks`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: float | None = None
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:  # "stop"; collections run one at a time (under the GIL)
            elapsed, self._started = time.perf_counter() - self._started, None
            generation = min(int(info.get("generation", 2)), 2)
            with self._lock:
                self.collections[generation] += 1
                self.seconds[generation] += elapsed

    def install(self) -> GCPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def snapshot(self) -> dict[str, Any]:
        """`{"collections": [gen0, gen1, gen2], "pause_s": [...], "frozen_objects": n}`."""
        with self._lock:
            return {
                "collections": list(self.collections),
                "pause_s": [round(s, 4) for s in self.seconds],
                "frozen_objects": gc.get_freeze_count(),
            }


GC_PAUSES = GCPauses()
"""The process's counter (one garbage collector per process); `create_app` installs it."""
