"""`GenerationStages`: the phases of a generation on threads of their own, so that the requests in flight overlap.

A generation has three phases: `encode` (prompt to text conditioning, starting noise), `denoise` (the transformer
loop) and `decode` (VAE, pixels, image file, base64). Each phase has one thread and, on CUDA, one stream; a phase
runs one request at a time, first come first served. With two or more requests in flight (`--workers`), one
request's encoding and decoding run while another denoises, on other streams, instead of leaving the GPU idle
between denoising loops.

Contract of `run(phase, fn, *args)`:
- `fn(*args)` runs on the phase's thread, in a copy of the caller's `contextvars` context (so the request's cache
  scope, its stop check and anything else the caller set are seen), under `torch.inference_mode` and the phase's
  CUDA stream; the call returns `fn`'s result (or raises its exception) once the phase's GPU work is finished, so its
  tensors may be read from any stream, and `args` stay referenced until then (no other stream reuses their memory
  while a kernel may still read them), failures included.
- Outputs equal those of the same phases run one after another in one thread: each phase runs the same kernels in
  the same order on one stream, and no state is shared between requests but the weights.
- On CUDA the denoise phase's stream has a higher priority than the others (`STREAM_PRIORITIES`): when requests
  overlap, the GPU schedules the denoising loop's kernels first and fits the other phases' around them, since the
  denoising loop is what bounds throughput. Priorities change which kernel runs when, never what a kernel computes.
- A phase always runs on the same thread, so thread-local state (cuDNN's attention plans, cuBLAS handles,
  torch.compile's settings from torch 2.12 on) is built once, by the warm-up, rather than once per worker thread.

`inline(phase, fn, *args)` has the same signature and runs `fn` in the calling thread (one request at a time in
every phase): the mode for offloaded and multi-process models, whose phases move weights or run collectives.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

PHASES = ("encode", "denoise", "decode")

STREAM_PRIORITIES = {"encode": 0, "denoise": -1, "decode": 0}
"""CUDA stream priority per phase (lower is higher; 0 is the default, -1 the next level up on every current GPU)."""

_T = TypeVar("_T")


class GenerationStages:
    """One thread (and CUDA stream on a CUDA `device`) per phase; see the module docstring."""

    def __init__(self, device: torch.device | str, phases: tuple[str, ...] = PHASES) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._streams = {
            phase: torch.cuda.Stream(self.device, priority=STREAM_PRIORITIES.get(phase, 0)) if cuda else None
            for phase in phases
        }
        self._executors = {
            phase: ThreadPoolExecutor(1, thread_name_prefix=f"dicache-{phase}", initializer=self._enter_thread)
            for phase in phases
        }
        self._closed = False

    def _enter_thread(self) -> None:
        if self.device.type == "cuda" and self.device.index is not None:  # the model's GPU is this thread's
            torch.cuda.set_device(self.device)

    def run(self, phase: str, fn: Callable[..., _T], *args: Any) -> _T:
        return self.submit(phase, fn, *args).result()

    def submit(self, phase: str, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """`run` without waiting: `fn` is queued on the phase's thread (after what is queued there already, before
        what comes later) and the future gives its result once its GPU work is finished."""
        if self._closed:
            raise RuntimeError("GenerationStages: closed")
        if phase not in self._executors:
            raise ValueError(f"phase={phase!r} is invalid: must be one of {', '.join(self._executors)}")
        context = contextvars.copy_context()
        return self._executors[phase].submit(context.run, self._in_phase, phase, fn, args)

    def _in_phase(self, phase: str, fn: Callable[..., _T], args: tuple) -> _T:
        stream = self._streams[phase]
        with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                result = fn(*args)
            except BaseException:
                _finish_queued_work(stream)  # a failed phase's kernels may still read `args`: wait before they go
                raise
            if stream is not None:
                stream.synchronize()
        return result

    def thread_of(self, phase: str) -> threading.Thread | None:
        """The phase's thread once it has run something (for tests and diagnostics)."""
        threads = getattr(self._executors[phase], "_threads", ())
        return next(iter(threads), None)

    def close(self) -> None:
        """Finish what was submitted and stop the threads."""
        self._closed = True
        for executor in self._executors.values():
            executor.shutdown(wait=True)


def _finish_queued_work(stream: torch.cuda.Stream | None) -> None:
    """Wait for what `stream` has queued, after its phase failed; a device error surfacing here is left to the
    phase's own exception."""
    if stream is not None:
        with contextlib.suppress(RuntimeError):
            stream.synchronize()


def inline(phase: str, fn: Callable[..., _T], *args: Any) -> _T:
    """`GenerationStages.run` in the calling thread (sequential mode)."""
    with torch.inference_mode():
        return fn(*args)
