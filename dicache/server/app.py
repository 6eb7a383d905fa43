"""`create_app`: the FastAPI application serving one cache-enabled pipeline the OpenAI way.

Endpoints: `POST /v1/images/generations`, `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`, `GET /metrics`.
Generations run in `JobQueue` worker threads; the event loop only parses, validates, waits and answers, so a slow
generation never blocks `/health` or `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..config import CacheConfig
from ..errors import DicacheError
from ..profiles import profile_source
from .backend import GenerationStopped
from .body_limit import BodySizeLimitMiddleware
from .errors import ApiError, install_error_handlers
from .generation import Defaults, GenerationSpec, resolve
from .jobs import Job, JobQueue, QueueFullError, ShuttingDownError
from .metrics import MetricsMiddleware, ServerMetrics
from .schemas import (
    GUIDANCE_DOC,
    ErrorResponse,
    GenerationInfo,
    ImageGenerationRequest,
    ImageObject,
    ImagesResponse,
    ModelCard,
    ModelList,
    Timings,
)
from .settings import ServerSettings

log = logging.getLogger("dicache.server")

ENDPOINTS = frozenset({"/v1/images/generations", "/v1/models", "/health", "/metrics"})
DISCONNECT_POLL_S = 0.05


class Backend(Protocol):
    """What the app needs from a backend (`PipelineBackend` is the real one)."""

    cache_config: CacheConfig
    defaults: Defaults
    num_blocks: int | None

    def generate(self, spec: GenerationSpec, should_stop: Callable[[], bool] | None = None) -> Any: ...


GENERATE_DESCRIPTION = f"""Generate images (OpenAI Images API compatible; only `response_format="b64_json"`).

Extra fields: `negative_prompt`, `num_inference_steps`, `guidance_scale`, `seed`, `enable_cache`, `cache_dit_params`.

**guidance_scale**: {GUIDANCE_DOC}

**size**: "WIDTHxHEIGHT", each side a multiple of 16 within the server's limits.

**Caching**: the server's settings come from `SGLANG_CACHE_DIT_*` over its settings profile (`--profile`) at start-up;
`enable_cache` and `cache_dit_params` (keys as in cache-dit / SGLang, e.g. `residual_diff_threshold`) override them
for this request only. The response's `cache_stats` has the request's computed / cached steps per CFG branch. Same
seed and parameters give a bitwise identical image, whatever else the server is doing.

Errors: 400 (bad field: the message names it, the value and what is allowed), 413 (body too large), 429 (queue full),
503 (shutting down), 504 (request timeout).
"""


def create_app(
    backend: Backend, settings: ServerSettings | None = None, metrics: ServerMetrics | None = None
) -> FastAPI:
    """The app; its queue starts with the app's lifespan and drains (finishing accepted requests) on shutdown."""
    settings = settings or ServerSettings()
    metrics = metrics or ServerMetrics()
    started = int(time.time())

    def run_job(job: Job) -> Any:
        try:
            result = backend.generate(job.payload, should_stop=job.stop.is_set)
        except GenerationStopped:
            metrics.generations.labels("stopped").inc()
            raise
        except BaseException:
            metrics.generations.labels("failed").inc()
            raise
        metrics.generations.labels("ok").inc()
        stats = getattr(result, "stats", None)
        if stats is not None:
            metrics.observe_generation(stats.computed_calls, stats.cached_calls, stats.compute_fraction)
        return result

    queue = JobQueue(run_job, capacity=settings.max_queue, workers=settings.workers, on_change=metrics.set_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        queue.start()
        log.info(
            "dicache server ready: model %s, %d worker(s), queue %d",
            settings.model_id,
            queue.num_workers,
            queue.capacity,
        )
        try:
            yield
        finally:
            await asyncio.to_thread(queue.shutdown, True)
            log.info("dicache server stopped: every accepted request was answered")

    app = FastAPI(
        title="dicache server",
        version="0.1.0",
        description="OpenAI-compatible image generation with DBCache step caching (SGLANG_CACHE_DIT_* settings).",
        lifespan=lifespan,
    )
    app.state.settings, app.state.metrics, app.state.queue, app.state.backend = settings, metrics, queue, backend
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics, endpoints=ENDPOINTS)

    errors: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 413, 429, 503, 504)}

    @app.post(
        "/v1/images/generations",
        response_model=ImagesResponse,
        responses=errors,
        summary="Generate images",
        description=GENERATE_DESCRIPTION,
    )
    async def generate_images(body: ImageGenerationRequest, request: Request) -> ImagesResponse:
        arrived = time.monotonic()
        spec = resolve(body, settings, backend.defaults, backend.cache_config, backend.num_blocks)
        try:
            job = queue.submit(spec)
        except QueueFullError as exc:
            raise ApiError(429, str(exc), code="queue_full") from None
        except ShuttingDownError as exc:
            raise ApiError(503, str(exc), code="shutting_down") from None
        result = await _await_job(queue, job, request, arrived + settings.request_timeout_s, settings)
        return ImagesResponse(
            created=int(time.time()),
            data=[ImageObject(b64_json=b, sha256=h) for b, h in zip(result.images_b64, result.sha256)],
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
            timings=Timings(queued_s=round(job.queued_s, 6), generate_s=round(job.run_s, 6)),
        )

    @app.get("/v1/models", response_model=ModelList, summary="The served model")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_id, created=started)])

    @app.get("/v1/models/{model_id}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def get_model(model_id: str) -> ModelCard:
        if model_id != settings.model_id:
            raise ApiError(
                404,
                f"model {model_id!r} is not served here; this server serves {settings.model_id!r}",
                "model",
                "model_not_found",
            )
        return ModelCard(id=settings.model_id, created=started)

    @app.get("/health", summary="Liveness, queue state and the start-up cache settings")
    async def health() -> JSONResponse:
        body = {
            "status": "shutting_down" if queue.closing else "ok",
            "model": settings.model_id,
            "variant": backend.defaults.variant,
            "queue": {
                "waiting": queue.waiting,
                "running": queue.running,
                "capacity": queue.capacity,
                "workers": queue.num_workers,
            },
            "cache": {
                "enabled_by_default": bool(backend.cache_config.enable_cache),
                "settings": backend.cache_config.model_dump(),
                "sources": backend.cache_config.sources(),
                "profile": profile_source(backend.cache_config),
            },
        }
        return JSONResponse(body, status_code=503 if queue.closing else 200)

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus_metrics() -> Response:
        content, media_type = metrics.render()
        return Response(content, media_type=media_type)

    return app


async def _await_job(queue: JobQueue, job: Job, request: Request, deadline: float, settings: ServerSettings) -> Any:
    """The job's result; 504 past `deadline`, 499 if the client went away (both drop the job if not started)."""
    result = asyncio.wrap_future(job.future)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait(
            {result, watcher}, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:  # the handler was cancelled (Ray Serve does it when the client leaves)
        result.add_done_callback(_consume)
        queue.cancel(job)  # drop it if waiting, stop it if generating
        raise
    finally:
        watcher.cancel()
    if result in done:
        try:
            return result.result()
        except ApiError:
            raise
        except GenerationStopped:
            pass  # stopped because the request was abandoned meanwhile: answer below as timeout / disconnect
        except (DicacheError, ValueError) as exc:
            raise ApiError(400, f"the pipeline rejected the request: {exc}") from None
        except Exception as exc:
            log.exception("generation failed")
            raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}") from None
    result.add_done_callback(_consume)  # its late outcome (e.g. GenerationStopped) is nobody's business now
    dropped = queue.cancel(job)
    if watcher in done and watcher.result():
        log.info("client disconnected; %s", "its queue slot was freed" if dropped else "its generation was stopped")
        raise ApiError(499, "client closed the request")
    where = "waiting for a worker" if dropped else "generating"
    raise ApiError(
        504,
        f"request timed out after {settings.request_timeout_s:g} s ({where}); server option --timeout",
        code="timeout",
    )


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _disconnected(request: Request) -> bool:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    return True
