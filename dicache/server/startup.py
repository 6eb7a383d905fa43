"""A server process's start-up, phase by phase (`/v1/server_info` "startup", and one log line at the end), so that a
benchmark reads where the time and the memory went instead of guessing.

Phases, in order (a phase that did not run is absent): `imports` (from the process's start until the command runs:
the interpreter, torch and dicache imported), `weights` (the checkpoint read, or random weights drawn), `quantization`
(while the weights are read: `Krea2Pipeline.load_timings`), `speed` (what `--quantization` / `--compile` do after
loading: a split model's quantisation, wrapping for compile), `compile_artifact` (putting the artifact into the
compile caches), `warm_up` (the warm-up generations: compiling, or loading compiled code, and running),
`text_lengths` (every prompt length met once), `artifact_save`. `ready_s` is the time from the process's start to
the end of the last phase. `gpu_GB` is, per phase on CUDA: the caching allocator's peak reserved memory during the
phase (`torch`) and what this process holds on the GPU at its end as NVML reports it (`process`: the CUDA context
included; what nvidia-smi lists).
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import torch

from .gpu_health import GpuHealth

GB = 1e9


def process_start_time() -> float | None:
    """This process's start as Unix time, to a clock tick (10 ms), None where unknown (not Linux).

    `/proc/self/stat`'s start time counts clock ticks since boot; the time since boot now is `CLOCK_BOOTTIME`
    (nanoseconds), so the start is that long before now. (The boot time in `/proc/stat` is whole seconds: adding the
    ticks to it put the start up to a second early, and every phase measured from it, `imports` first, that much
    longer.)"""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, the 22nd field: clock ticks after boot
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME off Linux
        return None


class StartupTimeline:
    """Seconds and GPU memory per start-up phase (see the module docstring); `to_dict` is the report."""

    def __init__(self, started: float | None = None, clock=time.time) -> None:
        self.clock = clock
        self.started = started if started is not None else (process_start_time() or clock())
        self.phases: dict[str, float] = {}
        self.gpu_gb: dict[str, dict[str, float | None]] = {}
        self.details: dict[str, Any] = {}
        self.device: torch.device | None = None
        self._health: GpuHealth | None = None
        self.ended = self.started

    def imports_done(self, entered: float | None = None) -> None:
        """Record `imports`: the process's start until now (call where the command starts); with `entered` (when the
        command line's entry began, `dicache.models.prefetch.ENTERED`), `details["imports"]` splits it:
        `interpreter_s` (Python and `dicache` starting) and `modules_s` (the command's modules: torch, the server),
        and says how much of it waited: `cpu_s`, the calling (main) thread's CPU seconds since the process started
        (the rest of the phase it waited: on the disk, or for the GIL), and `major_page_faults`, the process's pages
        read from disk through memory maps so far (shared libraries; the prefetch reads, it does not fault)."""
        now = self.clock()
        self.add("imports", now - self.started)
        if entered is not None and self.started <= entered <= now:
            self.details["imports"] = {
                "interpreter_s": round(entered - self.started, 3),
                "modules_s": round(now - entered, 3),
                "cpu_s": round(time.thread_time(), 3),
                "major_page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt,
            }

    def add(self, name: str, seconds: float) -> None:
        """A phase measured elsewhere (e.g. the loader's `weights` and `quantization`)."""
        self.phases[name] = round(self.phases.get(name, 0.0) + float(seconds), 3)
        self.ended = max(self.ended, self.clock())

    def watch(self, device: Any) -> None:
        """Measure GPU memory per phase on `device` from now on (nothing for a device other than CUDA)."""
        device = torch.device(device)
        if device.type != "cuda":
            return
        self.device = device
        self._health = GpuHealth.open([device])

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (added to an earlier one of that name); on CUDA, after the device's work."""
        cuda = self.device is not None and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = self.clock()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
                process = self._health.process_memory() if self._health is not None else None
                self.gpu_gb[name] = {
                    "torch": round(torch.cuda.max_memory_reserved(self.device) / GB, 3),
                    "process": None if process is None else round(process / GB, 3),
                }
            self.add(name, self.clock() - start)

    def to_dict(self) -> dict[str, Any]:
        return {
            "process_start_unix": round(self.started, 3),
            "phases_s": dict(self.phases),
            "ready_s": round(self.ended - self.started, 3),
            "gpu_GB": dict(self.gpu_gb),
            **self.details,
        }

    def line(self) -> str:
        """One line for the log: `ready in 41.2 s (imports 6.1, weights 9.8, ...)`."""
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.phases.items())
        return f"ready in {self.ended - self.started:.1f} s after the process started ({parts})"
