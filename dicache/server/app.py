"""`create_app`: the FastAPI application serving one cache-enabled pipeline the OpenAI way.

Endpoints: `POST /v1/images/generations`, `GET /v1/models`, `GET /v1/models/{id}`, `GET /v1/server_info`,
`GET`/`HEAD /health`, `GET /health_generate`, `GET /metrics` (and `/docs`, `/openapi.json` with `ServerSettings.docs`).
Generations run in `JobQueue` worker threads; the event loop only parses, validates, waits and answers (`handling`),
so a slow generation never blocks `/health` or `/metrics`.

Everything a deployment relies on lives inside the app, so that any ASGI host serves it alike (uvicorn through
`dicache serve`, Ray Serve): the API key (`auth`), the drain on shutdown (`drain`, run by the lifespan shutdown or
earlier by the host, e.g. on SIGTERM), body size and body-read time limits (`body_limit`), and the metrics.
Middleware order, outermost first: metrics, drain, API key, body limits, then the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..settings.cache_config import CacheConfig
from ..settings.profiles import profile_source
from .auth import ApiKeyMiddleware
from .body_limit import BodyLimitMiddleware
from .drain import Drain, DrainMiddleware
from .errors import ApiError, install_error_handlers
from .gc_pauses import GC_PAUSES
from .generation import Defaults, GenerationSpec, resolve
from .handling import GenerationProbe, await_job, job_runner, parse_generation_request, response_body, submit
from .jobs import JobQueue
from .memory import memory_breakdown
from .metrics import MetricsMiddleware, ServerMetrics
from .openapi import generation_request_schema, install_openapi, request_body, responses
from .schemas import (
    GUIDANCE_DOC,
    IGNORED_FIELDS,
    GenerationInfo,
    HealthStatus,
    ImageObject,
    ImagesResponse,
    ModelCard,
    ModelList,
    ProbeResult,
    Timings,
)
from .settings import ANSWER_TIMEOUT_S, ServerSettings

log = logging.getLogger("dicache.server")

GENERATIONS = "/v1/images/generations"
ENDPOINTS = frozenset(
    {GENERATIONS, "/v1/models", "/v1/server_info", "/health", "/health_generate", "/metrics", "/docs", "/openapi.json"}
)


class Backend(Protocol):
    """What the app needs from a backend (`PipelineBackend` is the real one)."""

    cache_config: CacheConfig
    defaults: Defaults
    num_blocks: int | None

    def generate(self, spec: GenerationSpec, should_stop: Callable[[], bool] | None = None) -> Any: ...


GENERATE_DESCRIPTION = f"""Generate images (OpenAI Images API compatible).

Extra fields: `negative_prompt`, `num_inference_steps`, `guidance_scale`, `seed`, `enable_cache`, `cache_dit_params`.

**OpenAI fields**: `output_format` (png, jpeg, webp) and `output_compression` (jpeg / webp quality) are honoured;
`response_format` must be `b64_json`; `background` may be `auto` or `opaque`; `stream` must be false. Accepted and
ignored: {", ".join(IGNORED_FIELDS)}. Numbers and booleans are strict (`"n": true` or `"guidance_scale": "4.5"` is a
400).

**guidance_scale**: {GUIDANCE_DOC}

**size**: "WIDTHxHEIGHT" in plain digits, each side a multiple of 16 within the server's limits (the schema's
pattern lists them).

**Caching**: the server's settings come from `SGLANG_CACHE_DIT_*` over its settings profile (`--profile`) at start-up;
`enable_cache` and `cache_dit_params` (keys as in cache-dit / SGLang, e.g. `residual_diff_threshold`) override them
for this request only. The response's `cache_stats` has the request's computed / cached steps per CFG branch. Same
seed and parameters give a bitwise identical image, whatever else the server is doing.

Errors: 400 (bad field: the message names it, the value and what is allowed), 401 (API key), 408 (body too slow),
413 (body too large), 429 (queue full), 503 (shutting down), 504 (not answered within the server's --timeout,
waiting included). Every bound in this schema is the one the server applies.
"""


def create_app(
    backend: Backend,
    settings: ServerSettings | None = None,
    metrics: ServerMetrics | None = None,
    background: Sequence[Callable[[FastAPI], Awaitable[None]]] = (),
) -> FastAPI:
    """The app; its queue starts with the app's lifespan and drains (`app.state.drain`) on shutdown.

    `background`: coroutine functions of the app run as tasks for its lifetime (started once the queue runs,
    cancelled at shutdown before the drain), e.g. a Ray replica following its driver's drain (`ray.drain.follow`)."""
    settings = settings or ServerSettings()
    metrics = metrics or ServerMetrics()
    GC_PAUSES.install()
    metrics.set_model_info(model_info(backend, settings))
    device = getattr(getattr(backend, "pipe", None), "device", None)  # a torch.device
    if getattr(device, "type", None) == "cuda":
        metrics.watch_gpus([device])
    started = int(time.time())

    queue = JobQueue(
        job_runner(backend, metrics), capacity=settings.max_queue, workers=settings.workers, on_change=metrics.set_queue
    )
    drain = Drain(queue, settings.drain_grace_s, ANSWER_TIMEOUT_S)
    probe = GenerationProbe(queue, settings, backend.defaults)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        queue.start()
        log.info(
            "dicache server ready: model %s, %d worker(s), queue %d, API key %s",
            settings.model_id,
            queue.num_workers,
            queue.capacity,
            "required" if settings.api_key else "not required",
        )
        tasks = [asyncio.ensure_future(run(app)) for run in background]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await drain.run()
            await asyncio.to_thread(queue.shutdown, True, ANSWER_TIMEOUT_S)
            log.info(
                "dicache server stopped: %s",
                f"{drain.unfinished} unfinished generation(s) answered 503"
                if drain.unfinished
                else "every accepted request was answered",
            )

    app = FastAPI(
        title="dicache server",
        version="0.1.0",
        description="OpenAI-compatible image generation with DBCache step caching (SGLANG_CACHE_DIT_* settings).",
        lifespan=lifespan,
        docs_url="/docs" if settings.docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if settings.docs else None,
    )
    app.state.settings, app.state.metrics, app.state.queue, app.state.backend = settings, metrics, queue, backend
    app.state.drain = drain
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s, drain=drain
    )
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, protect_metrics=settings.protect_metrics)
    app.add_middleware(DrainMiddleware, drain=drain)
    app.add_middleware(MetricsMiddleware, metrics=metrics, endpoints=ENDPOINTS)

    body_schema = generation_request_schema(settings, backend.defaults, backend.cache_config, backend.num_blocks)
    install_openapi(app, settings, {GENERATIONS: body_schema})

    @app.post(
        GENERATIONS,
        response_model=ImagesResponse,
        responses=responses(settings, GENERATIONS, (400, 408, 413, 429, 503, 504)),
        summary="Generate images",
        description=GENERATE_DESCRIPTION,
        openapi_extra={"requestBody": request_body(body_schema)},
    )
    async def generate_images(request: Request) -> ImagesResponse | Response:
        arrived = time.monotonic()
        body = await parse_generation_request(request)
        spec = resolve(body, settings, backend.defaults, backend.cache_config, backend.num_blocks)
        job = submit(queue, spec)
        result = await await_job(queue, job, request, arrived + settings.request_timeout_s, settings)
        data_json = getattr(result, "data_json", None)  # serialised by the worker (`handling.images_json`)
        answer = ImagesResponse(
            created=int(time.time()),
            data=[]
            if data_json
            else [ImageObject(b64_json=b, sha256=h) for b, h in zip(result.images_b64, result.sha256)],
            output_format=spec.output_format,
            size=f"{spec.width}x{spec.height}",
            cache_stats=result.stats.to_dict() if result.stats is not None else None,
            generation=GenerationInfo(
                model=settings.model_id,
                variant=spec.variant,
                width=spec.width,
                height=spec.height,
                n=spec.n,
                num_inference_steps=spec.num_inference_steps,
                guidance_scale=spec.guidance_scale,
                seed=spec.seed,
                enable_cache=spec.enable_cache,
                cache_overrides=spec.cache_overrides,
            ),
            timings=Timings(
                queued_s=round(job.queued_s, 6),
                generate_s=round(job.run_s, 6),
                phases=rounded_phases(getattr(result, "phases", None)),
            ),
        )
        if data_json:
            return Response(response_body(answer, data_json), media_type="application/json")
        return answer

    @app.get(
        "/v1/models",
        response_model=ModelList,
        responses=responses(settings, "/v1/models", (503,)),
        summary="The served model",
    )
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_id, created=started)])

    @app.get(
        "/v1/models/{model_id}",
        response_model=ModelCard,
        responses=responses(settings, "/v1/models/{model_id}", (404, 503)),
        summary="One served model",
    )
    async def get_model(model_id: str) -> ModelCard:
        if model_id != settings.model_id:
            raise ApiError(
                404,
                f"model {model_id!r} is not served here; this server serves {settings.model_id!r}",
                "model",
                "model_not_found",
            )
        return ModelCard(id=settings.model_id, created=started)

    @app.get(
        "/v1/server_info",
        responses=responses(settings, "/v1/server_info", (503,)),
        summary="Queue state, limits, the start-up cache settings, the GPU memory breakdown and the start-up's phases "
        "(API key if set)",
    )
    async def server_info() -> dict[str, Any]:
        return {
            "status": _status(queue, drain),
            "model": settings.model_id,
            "variant": backend.defaults.variant,
            "queue": {
                "waiting": queue.waiting,
                "running": queue.running,
                "capacity": queue.capacity,
                "workers": queue.num_workers,
            },
            "limits": settings.public(),
            "cache": {
                "enabled_by_default": bool(backend.cache_config.enable_cache),
                "settings": backend.cache_config.model_dump(),
                "sources": backend.cache_config.sources(),
                "profile": profile_source(backend.cache_config),
            },
            "memory": memory_breakdown(getattr(backend, "pipe", None)),
            "gc": GC_PAUSES.snapshot(),
            "startup": backend.startup_report()
            if hasattr(backend, "startup_report")
            else getattr(backend, "startup", None),
        }

    @app.head("/health", include_in_schema=False)  # load balancers probe with HEAD too
    @app.get(
        "/health",
        response_model=HealthStatus,
        responses={503: {"model": HealthStatus, "description": "draining: the server is shutting down"}},
        summary="Liveness: 200 ok, or 503 while draining",
    )
    async def health() -> JSONResponse:
        status = _status(queue, drain)
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get(
        "/health_generate",
        response_model=ProbeResult,
        responses=responses(settings, "/health_generate", (503,)),
        summary="Generates a tiny image through the queue: 200 once it is done",
    )
    async def health_generate() -> JSONResponse:
        if drain.draining or queue.closing:
            raise ApiError(503, "the server is draining", code="shutting_down")
        seconds = await probe.run(settings.request_timeout_s)
        return JSONResponse({"status": "ok", "generate_s": round(seconds, 6)})

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses=responses(settings, "/metrics", ()),
        summary="Prometheus metrics (text exposition format)",
    )
    async def prometheus_metrics() -> Response:
        content, media_type = metrics.render()
        return Response(content, media_type=media_type)

    return app


def model_info(backend: Any, settings: ServerSettings) -> dict[str, Any]:
    """Labels of `dicache_model_info`: id, variant, device, dtype, blocks."""
    pipe = getattr(backend, "pipe", None)
    transformer = getattr(pipe, "transformer", None)
    parameter = next(transformer.parameters(), None) if transformer is not None else None
    return {
        "model_id": settings.model_id,
        "variant": backend.defaults.variant,
        "device": getattr(pipe, "device", "unknown"),
        "dtype": str(parameter.dtype).removeprefix("torch.") if parameter is not None else "unknown",
        "num_blocks": backend.num_blocks,
    }


def _status(queue: JobQueue, drain: Drain) -> str:
    return "draining" if drain.draining or queue.closing else "ok"


def rounded_phases(phases: dict[str, float] | None) -> dict[str, float] | None:
    """A generation's phase seconds for the answer's `timings.phases`, to the microsecond; None when not measured."""
    return {name: round(seconds, 6) for name, seconds in phases.items()} if phases else None
