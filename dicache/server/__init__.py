"""`dicache serve`: an OpenAI-compatible image server with step caching tuned by `SGLANG_CACHE_DIT_*`.

    from dicache.server import create_app, load_backend, ServerSettings
    app = create_app(load_backend(), ServerSettings(max_queue=8))

Modules: `settings` (limits), `schemas` (request/response bodies), `generation` (request -> validated spec),
`backend` (runs a spec on the cache-enabled pipeline), `jobs` (bounded queue + worker threads), `metrics`
(Prometheus), `body_limit` (413 on oversize bodies), `errors` (OpenAI-shaped errors), `app` (the endpoints),
`background` (run the app on loopback in a thread, for tests and benchmarks).
"""

from .app import create_app
from .backend import PipelineBackend, load_backend
from .settings import ServerSettings

__all__ = ["PipelineBackend", "ServerSettings", "create_app", "load_backend"]
