"""`dicache serve`: an OpenAI-compatible image server with step caching tuned by `SGLANG_CACHE_DIT_*`.

    from dicache.server import create_app, load_backend, ServerSettings
    app = create_app(load_backend(), ServerSettings(max_queue=8))

Modules: `settings` (limits, API key, drain grace), `schemas` (request/response bodies), `generation` (request ->
validated spec), `backend` (runs a spec on the cache-enabled pipeline), `stop_points` (abandoned generations stop
between blocks), `jobs` (bounded queue + worker threads), `metrics` (Prometheus), `auth` (API key), `drain`
(graceful shutdown), `body_limit` (413 / 408 on oversize or slow bodies), `errors` (OpenAI-shaped errors),
`handling` (a generation request parsed, queued, run, awaited and answered), `app` (the endpoints), `runner`
(uvicorn with connection limits and SIGTERM -> drain -> exit 0), `background` (the runner on loopback in a thread,
for tests and benchmarks).

On Ray Serve (the optional `dicache[ray]` extra; nothing outside it imports Ray): the `ray` package (replicas of
this app, the `serve run` / KubeRay application builder, the driver of `dicache serve --ray`; its docstring maps its
modules), with `metrics_merge` (`/metrics` aggregated across replicas). `ray_serve` and `ray_proxy` are the earlier
import paths of its builder and of Serve's proxy callback, kept as aliases.
"""

from __future__ import annotations

from dicache._lazy import lazy_getattr

_EXPORTS = {
    "create_app": ".app",
    "PipelineBackend": ".backend",
    "load_backend": ".backend",
    "ServerSettings": ".settings",
}
__all__ = sorted(_EXPORTS)

# Imported on first use, so that `dicache --help` and `dicache generate` work without the serve extra.
__getattr__ = lazy_getattr(__name__, _EXPORTS)
