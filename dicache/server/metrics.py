"""Prometheus metrics of one server app, in their own `CollectorRegistry` (several apps in a process never clash).

- `dicache_http_requests_total{endpoint,status}`: every answered request.
- `dicache_http_errors_total{endpoint,status}`: answers with status >= 400.
- `dicache_http_request_duration_seconds{endpoint}`: latency histogram, arrival to last byte.
- `dicache_queue_depth` / `dicache_generations_running`: requests waiting for a worker / being generated.
- `dicache_transformer_calls_total{kind="computed"|"cached"}`: transformer calls of finished generations.
- `dicache_cached_step_ratio`: cached / all transformer calls since start (0 before the first generation).
- `dicache_generation_compute_fraction`: histogram of each generation's compute fraction.
- `dicache_generations_total{outcome="ok"|"stopped"|"failed"}`: generations run by the workers; "stopped" ones were
  abandoned (client gone, timed out) and ended early.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


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
        self._lock = threading.Lock()
        self._computed = self._cached = 0
        for kind in ("computed", "cached"):
            self.calls.labels(kind)
        for outcome in ("ok", "stopped", "failed"):
            self.generations.labels(outcome)

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

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if status >= 400:
            self.errors.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI middleware: counts every HTTP answer by endpoint (known paths only, else 'other') and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: frozenset[str]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in self.endpoints else "other"
            self.metrics.observe_request(endpoint, status, time.perf_counter() - start)
