"""Prometheus metrics of one server app, in their own `CollectorRegistry` (several apps in a process never clash).

- `dicache_http_requests_total{endpoint,status}`: every answered request.
- `dicache_http_errors_total{endpoint,status}`: answers with status >= 400.
- `dicache_http_request_duration_seconds{endpoint}`: latency histogram, arrival to last byte.
- `dicache_queue_depth` / `dicache_generations_running`: requests waiting for a worker / being generated.
- `dicache_transformer_calls_total{kind="computed"|"cached"}`: transformer calls of finished generations.
- `dicache_cached_step_ratio`: cached / all transformer calls since start (0 before the first generation).
- `dicache_generation_compute_fraction`: histogram of each generation's compute fraction.
- `dicache_generations_total{outcome="ok"|"stopped"|"out_of_memory"|"non_finite"|"failed"}`: generations run by
  the workers; "stopped" ones were abandoned (client gone, timed out, server shutting down) and ended early,
  "out_of_memory" ones ran out of GPU memory (answered 503), "non_finite" ones produced NaN or inf (answered 500).
- `dicache_out_of_memory_errors_total{phase="encode"|"denoise"|"decode"}`: GPU out-of-memory errors by the phase
  they struck (`/health_generate` probes included).
- `dicache_request_wait_seconds` / `dicache_generation_seconds`: histograms of the time a generation waited for a
  worker, and of the worker's time on it (pipeline and image encoding).
- `dicache_images_total`, `dicache_denoise_steps_total`: images and denoising steps of finished generations.
- `dicache_transformer_flops_total`: estimated transformer FLOPs of finished generations (`dicache.sweep.flops`,
  matrix multiplications only, counted from the model config, the tokens and the blocks each call ran);
  `dicache_generation_achieved_tflops`: histogram of each generation's estimate / its pipeline seconds, the
  tensor-core work done per second (watch it next to GPU-busy percentage, which hides idle tensor cores).
- `dicache_build_info{version,python,torch}`, `dicache_model_info{model_id,variant,device,dtype,num_blocks}`.
- `dicache_gpu_*{gpu,name}`: the served GPUs' temperature, SM clock, power draw and limit, throttle reasons and memory
  used, read through NVML at each scrape (`gpu_health`; `watch_gpus`); absent without NVML.
- `process_resident_memory_bytes`, `process_open_fds`, `process_cpu_seconds_total`, ...: the process collector.

`/health_generate` probes are not counted in the generation metrics (only as HTTP requests).
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .gpu_health import GpuHealth, GpuHealthCollector

OUTCOMES = ("ok", "stopped", "out_of_memory", "non_finite", "failed")
"""`dicache_generations_total`'s outcomes."""
PHASES = ("encode", "denoise", "decode")
"""A generation's phases (`stages.PHASES`; repeated here: Ray's proxy imports this module without torch)."""
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
TFLOPS_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 750, 1000, 1500, 2000)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("dicache_http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.errors = Counter(
            "dicache_http_errors", "HTTP answers with status >= 400", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "dicache_http_request_duration_seconds",
            "Seconds from request arrival to the end of the answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("dicache_queue_depth", "Generation requests waiting for a worker", registry=r)
        self.running = Gauge("dicache_generations_running", "Generations in progress", registry=r)
        self.calls = Counter(
            "dicache_transformer_calls", "Transformer calls of finished generations", ["kind"], registry=r
        )
        self.cached_ratio = Gauge(
            "dicache_cached_step_ratio", "Cached / all transformer calls since the server started", registry=r
        )
        self.compute_fraction = Histogram(
            "dicache_generation_compute_fraction",
            "Per generation: transformer blocks run / blocks an uncached run would run",
            buckets=FRACTION_BUCKETS,
            registry=r,
        )
        self.generations = Counter(
            "dicache_generations", "Generations run by the workers, by outcome", ["outcome"], registry=r
        )
        self.wait = Histogram(
            "dicache_request_wait_seconds", "Seconds a generation waited for a worker", buckets=WAIT_BUCKETS, registry=r
        )
        self.generate_time = Histogram(
            "dicache_generation_seconds",
            "Seconds a worker spent on one generation (pipeline and image encoding)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.out_of_memory = Counter(
            "dicache_out_of_memory_errors", "GPU out-of-memory errors, by generation phase", ["phase"], registry=r
        )
        self.images = Counter("dicache_images", "Images of finished generations", registry=r)
        self.steps = Counter("dicache_denoise_steps", "Denoising steps of finished generations", registry=r)
        self.flops = Counter(
            "dicache_transformer_flops", "Estimated transformer FLOPs of finished generations", registry=r
        )
        self.tflops = Histogram(
            "dicache_generation_achieved_tflops",
            "Per generation: estimated transformer TFLOP / pipeline seconds",
            buckets=TFLOPS_BUCKETS,
            registry=r,
        )
        self.build = Info("dicache_build", "dicache build", registry=r)
        self.model = Info("dicache_model", "The served model", registry=r)
        ProcessCollector(registry=r)
        self.build.info(build_info())
        self._lock = threading.Lock()
        self.gpu_health: GpuHealth | None = None
        self._computed = self._cached = 0
        for kind in ("computed", "cached"):
            self.calls.labels(kind)
        for outcome in OUTCOMES:
            self.generations.labels(outcome)
        for phase in PHASES:
            self.out_of_memory.labels(phase)

    def watch_gpus(self, devices: Sequence[Any], nvml: Any = None) -> bool:
        """Export the health of `devices` (torch CUDA devices or indices; `gpu_health`) at each scrape, once; False
        (and nothing exported) where NVML is unavailable. `nvml`: the binding (default `pynvml`)."""
        if getattr(self, "gpu_health", None) is not None:
            return True
        self.gpu_health = GpuHealth.open(devices, nvml)
        if self.gpu_health is None:
            return False
        self.registry.register(GpuHealthCollector(self.gpu_health))
        return True

    def set_queue(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def observe_generation(self, computed_calls: int, cached_calls: int, compute_fraction: float) -> None:
        self.calls.labels("computed").inc(computed_calls)
        self.calls.labels("cached").inc(cached_calls)
        self.compute_fraction.observe(compute_fraction)
        with self._lock:
            self._computed += computed_calls
            self._cached += cached_calls
            total = self._computed + self._cached
            self.cached_ratio.set(self._cached / total if total else 0.0)

    def observe_work(
        self, images: int, steps: int, wait_s: float, generate_s: float, flops: float | None, pipeline_s: float
    ) -> None:
        """One finished generation: its images, steps, times and (if known) estimated FLOPs."""
        self.images.inc(images)
        self.steps.inc(steps)
        self.wait.observe(wait_s)
        self.generate_time.observe(generate_s)
        if flops is not None:
            self.flops.inc(flops)
            if pipeline_s > 0:
                self.tflops.observe(flops / pipeline_s / 1e12)

    def set_model_info(self, info: Mapping[str, object]) -> None:
        self.model.info({key: str(value) for key, value in info.items()})

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if status >= 400:
            self.errors.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def build_info() -> dict[str, str]:
    """dicache, Python and torch versions."""
    try:
        dicache_version = version("dicache")
    except PackageNotFoundError:  # a source checkout that was never installed
        dicache_version = "unknown"
    import torch  # only for its version: the metrics themselves never load torch (a Ray proxy imports them)

    return {"version": dicache_version, "python": platform.python_version(), "torch": torch.__version__}


CLIENT_CLOSED = 499
"""The status counted for a request whose client left before any answer was sent (nginx's convention)."""


class MetricsMiddleware:
    """Pure ASGI middleware: counts every HTTP answer by endpoint (known paths only, else 'other') and status. A
    request the app leaves unanswered counts as 499 when its client disconnected (e.g. in the middle of its body),
    else as 500."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: frozenset[str]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = None
        disconnected = False

        async def receive_and_watch() -> Message:
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive_and_watch, send_and_record)
        finally:
            if status is None:
                status = CLIENT_CLOSED if disconnected else 500
            path = scope.get("path", "")
            endpoint = path if path in self.endpoints else "other"
            self.metrics.observe_request(endpoint, status, time.perf_counter() - start)
