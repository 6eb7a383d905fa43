"""`dicache serve`: an OpenAI-compatible image server with step caching tuned by `SGLANG_CACHE_DIT_*`.

    from dicache.server import create_app, load_backend, ServerSettings
    app = create_app(load_backend(), ServerSettings(max_queue=8))

Modules: `settings` (limits, API key, drain grace), `schemas` (request/response bodies), `generation` (request ->
validated spec), `backend` (runs a spec on the cache-enabled pipeline), `stop_points` (abandoned generations stop
between blocks), `jobs` (bounded queue + worker threads), `metrics` (Prometheus), `auth` (API key), `drain`
(graceful shutdown), `body_limit` (413 / 408 on oversize or slow bodies), `errors` (OpenAI-shaped errors), `app`
(the endpoints), `runner` (uvicorn with connection limits and SIGTERM -> drain -> exit 0), `background` (the runner
on loopback in a thread, for tests and benchmarks).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "create_app": ".app",
    "PipelineBackend": ".backend",
    "load_backend": ".backend",
    "ServerSettings": ".settings",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Imported on first use, so that `dicache --help` and `dicache generate` work without the serve extra."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
