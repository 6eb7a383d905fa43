"""`create_app`: the FastAPI application serving one cache-enabled pipeline the OpenAI way.

Endpoints: `POST /v1/images/generations`, `GET /v1/models`, `GET /v1/models/{id}`, `GET /v1/server_info`,
`GET /health`, `GET /health_generate`, `GET /metrics` (and `/docs`, `/openapi.json` with `ServerSettings.docs`).
Generations run in `JobQueue` worker threads; the event loop only parses, validates, waits and answers, so a slow
generation never blocks `/health` or `/metrics`.

Everything a deployment relies on lives inside the app, so that any ASGI host serves it alike (uvicorn through
`dicache serve`, Ray Serve): the API key (`auth`), the drain on shutdown (`drain`, run by the lifespan shutdown or
earlier by the host, e.g. on SIGTERM), body size and body-read time limits (`body_limit`), and the metrics.
Middleware order, outermost first: metrics, drain, API key, body limits, then the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..config import CacheConfig
from ..errors import DicacheError
from ..profiles import profile_source
from .auth import ApiKeyMiddleware
from .backend import GenerationStopped
from .body_limit import BodyLimitMiddleware
from .drain import UNFINISHED_MESSAGE, Drain, DrainMiddleware
from .errors import ApiError, describe_validation_error, install_error_handlers
from .generation import Defaults, GenerationSpec, resolve
from .jobs import Job, JobQueue, QueueFullError, ShuttingDownError
from .metrics import MetricsMiddleware, ServerMetrics
from .schemas import (
    GUIDANCE_DOC,
    IGNORED_FIELDS,
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

GENERATIONS = "/v1/images/generations"
ENDPOINTS = frozenset(
    {GENERATIONS, "/v1/models", "/v1/server_info", "/health", "/health_generate", "/metrics", "/docs", "/openapi.json"}
)
DISCONNECT_POLL_S = 0.05
ANSWER_TIMEOUT_S = 10.0  # after the drain stopped the unfinished generations, wait this long for their answers


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

**size**: "WIDTHxHEIGHT", each side a multiple of 16 within the server's limits.

**Caching**: the server's settings come from `SGLANG_CACHE_DIT_*` over its settings profile (`--profile`) at start-up;
`enable_cache` and `cache_dit_params` (keys as in cache-dit / SGLang, e.g. `residual_diff_threshold`) override them
for this request only. The response's `cache_stats` has the request's computed / cached steps per CFG branch. Same
seed and parameters give a bitwise identical image, whatever else the server is doing.

Errors: 400 (bad field: the message names it, the value and what is allowed), 401 (API key), 408 (body too slow),
413 (body too large), 429 (queue full), 503 (shutting down), 504 (request timeout).
"""

REQUEST_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ImageGenerationRequest.model_json_schema()}},
    }
}


def create_app(
    backend: Backend, settings: ServerSettings | None = None, metrics: ServerMetrics | None = None
) -> FastAPI:
    """The app; its queue starts with the app's lifespan and drains (`app.state.drain`) on shutdown."""
    settings = settings or ServerSettings()
    metrics = metrics or ServerMetrics()
    metrics.set_model_info(model_info(backend, settings))
    started = int(time.time())

    def run_job(job: Job) -> Any:
        spec: GenerationSpec = job.payload
        try:
            result = backend.generate(spec, should_stop=job.stop.is_set)
        except GenerationStopped:
            if not spec.probe:
                metrics.generations.labels("stopped").inc()
            raise
        except BaseException:
            if not spec.probe:
                metrics.generations.labels("failed").inc()
            raise
        if spec.probe:
            return result
        metrics.generations.labels("ok").inc()
        stats = getattr(result, "stats", None)
        if stats is not None:
            metrics.observe_generation(stats.computed_calls, stats.cached_calls, stats.compute_fraction)
        metrics.observe_work(
            images=spec.n,
            steps=spec.num_inference_steps,
            wait_s=job.queued_s,
            generate_s=job.run_s,
            flops=getattr(result, "flops", None),
            pipeline_s=getattr(result, "pipeline_s", 0.0),
        )
        return result

    queue = JobQueue(run_job, capacity=settings.max_queue, workers=settings.workers, on_change=metrics.set_queue)
    drain = Drain(queue, settings.drain_grace_s, ANSWER_TIMEOUT_S)
    probe = _Probe(queue, settings, backend.defaults)

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
        try:
            yield
        finally:
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

    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorResponse} for code in (400, 401, 408, 413, 429, 503, 504)
    }

    @app.post(
        GENERATIONS,
        response_model=ImagesResponse,
        responses=errors,
        summary="Generate images",
        description=GENERATE_DESCRIPTION,
        openapi_extra=REQUEST_BODY_DOC,
    )
    async def generate_images(request: Request) -> ImagesResponse:
        arrived = time.monotonic()
        body = await parse_generation_request(request)
        spec = resolve(body, settings, backend.defaults, backend.cache_config, backend.num_blocks)
        job = _submit(queue, spec)
        result = await _await_job(queue, job, request, arrived + settings.request_timeout_s, settings)
        return ImagesResponse(
            created=int(time.time()),
            data=[ImageObject(b64_json=b, sha256=h) for b, h in zip(result.images_b64, result.sha256)],
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

    @app.get("/v1/server_info", summary="Queue state, limits and the start-up cache settings (API key if set)")
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
        }

    @app.get("/health", summary="Liveness: 200 ok, or 503 while draining")
    async def health() -> JSONResponse:
        status = _status(queue, drain)
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/health_generate", summary="Generates a tiny image through the queue: 200 once it is done")
    async def health_generate() -> JSONResponse:
        if drain.draining or queue.closing:
            raise ApiError(503, "the server is draining", code="shutting_down")
        seconds = await probe.run(settings.request_timeout_s)
        return JSONResponse({"status": "ok", "generate_s": round(seconds, 6)})

    @app.get("/metrics", summary="Prometheus metrics")
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


async def parse_generation_request(request: Request) -> ImageGenerationRequest:
    """The body as an `ImageGenerationRequest`, parsed by pydantic's JSON parser (bounded nesting, strict types);
    any problem is a 400 naming the field, or the position in the JSON."""
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type != "application/json" and not content_type.endswith("+json"):
        raise ApiError(400, "request body is not JSON: send a JSON object with 'Content-Type: application/json'")
    raw = await request.body()
    if not raw.strip():
        raise ApiError(400, "request body is missing: send a JSON object with at least 'prompt'")
    try:
        return ImageGenerationRequest.model_validate_json(raw)
    except ValidationError as exc:
        message, param = describe_validation_error(exc.errors())
        raise ApiError(400, message, param) from None


def _submit(queue: JobQueue, spec: GenerationSpec, bypass_capacity: bool = False) -> Job:
    try:
        return queue.submit(spec, bypass_capacity=bypass_capacity)
    except QueueFullError as exc:
        raise ApiError(429, str(exc), code="queue_full") from None
    except ShuttingDownError as exc:
        raise ApiError(503, str(exc), code="shutting_down") from None


def _status(queue: JobQueue, drain: Drain) -> str:
    return "draining" if drain.draining or queue.closing else "ok"


class _Probe:
    """`/health_generate`: one tiny generation (smallest size, 1 step, no CFG, no cache) through the queue, shared
    by concurrent probes and let in past a full queue, so probes never add up or get 429."""

    def __init__(self, queue: JobQueue, settings: ServerSettings, defaults: Defaults) -> None:
        side = max(settings.min_side, math.lcm(settings.size_multiple, defaults.size_multiple))
        self.queue = queue
        self.spec = GenerationSpec(
            prompt="a",
            negative_prompt=None,
            n=1,
            width=side,
            height=side,
            num_inference_steps=1,
            guidance_scale=1.0,
            seed=0,
            cache=CacheConfig.defaults(),  # caching off
            variant=defaults.variant,
            probe=True,
        )
        self._job: Job | None = None

    async def run(self, timeout_s: float) -> float:
        if self._job is None or self._job.future.done():
            self._job = _submit(self.queue, self.spec, bypass_capacity=True)
        job = self._job
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.future)), timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(503, f"the probe generation did not finish within {timeout_s:g} s", code="timeout") from None
        except ShuttingDownError as exc:
            raise ApiError(503, str(exc), code="shutting_down") from None
        except Exception as exc:
            log.exception("health probe generation failed")
            raise ApiError(503, f"the probe generation failed: {type(exc).__name__}: {exc}") from None
        return job.run_s


async def _await_job(queue: JobQueue, job: Job, request: Request, deadline: float, settings: ServerSettings) -> Any:
    """The job's result; 504 past `deadline`, 499 if the client went away (both drop the job if not started, or
    stop it at its next block), 503 if the drain stopped it."""
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
        except ShuttingDownError as exc:  # dropped from the queue by the drain
            raise ApiError(503, str(exc), code="shutting_down") from None
        except GenerationStopped:
            if job.stop_reason == "shutdown":
                raise ApiError(503, UNFINISHED_MESSAGE, code="shutting_down") from None
            # stopped because the request was abandoned meanwhile: answer below as timeout / disconnect
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
