"""One generation request's way through the server, apart from routing: its JSON body parsed into an
`ImageGenerationRequest`, its `GenerationSpec` queued (429 / 503 when it cannot be), run on a worker (with its
metrics), and awaited while watching the client and the deadline (499 / 504, the job dropped or stopped); the
outcome becomes the answer or an `ApiError`: out of GPU memory a 503 with `Retry-After` (code "out_of_memory"),
non-finite output a 500 (code "non_finite_output"). Also the `/health_generate` probe, a shared tiny generation.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ValidationError

from ..errors import DicacheError, NonFiniteOutputError
from ..settings.cache_config import CacheConfig
from .backend import GenerationOutOfMemory, GenerationStopped
from .drain import UNFINISHED_MESSAGE
from .errors import ApiError, describe_validation_error, key_at_error
from .generation import Defaults, GenerationSpec
from .jobs import Job, JobQueue, QueueFullError, ShuttingDownError
from .metrics import ServerMetrics
from .schemas import ImageGenerationRequest
from .settings import ServerSettings

log = logging.getLogger("dicache.server")

DISCONNECT_POLL_S = 0.05
_EMPTY_DATA = b'"data":[]'


async def parse_generation_request(request: Request) -> ImageGenerationRequest:
    """The body as an `ImageGenerationRequest`, parsed by pydantic's JSON parser (bounded nesting, strict types);
    any problem is a 400 naming the field, or the position in the JSON and the key whose value is there."""
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
        key = key_at_error(raw, message) if message.startswith("malformed JSON body") else None
        if key is not None:
            message += f" (the value of {key!r})"
            param = key if key in ImageGenerationRequest.model_fields else None
        raise ApiError(400, message, param) from None


def submit(queue: JobQueue, spec: GenerationSpec, bypass_capacity: bool = False) -> Job:
    """Queue `spec`; a full queue is a 429, a closing one a 503."""
    try:
        return queue.submit(spec, bypass_capacity=bypass_capacity)
    except QueueFullError as exc:
        raise ApiError(429, str(exc), code="queue_full") from None
    except ShuttingDownError as exc:
        raise ApiError(503, str(exc), code="shutting_down") from None


def job_runner(backend: Any, metrics: ServerMetrics) -> Callable[[Job], Any]:
    """What a `JobQueue` worker runs for a job: the backend's generation of its `GenerationSpec` (stopped when the
    job's `stop` is set), counted in `metrics` by outcome (probes are not counted)."""

    def run_job(job: Job) -> Any:
        spec: GenerationSpec = job.payload
        try:
            result = backend.generate(spec, should_stop=job.stop.is_set)
        except GenerationStopped:
            if not spec.probe:
                metrics.generations.labels("stopped").inc()
            raise
        except GenerationOutOfMemory as exc:
            metrics.out_of_memory.labels(exc.phase).inc()  # every one, probes included: the device's memory
            if not spec.probe:
                metrics.generations.labels("out_of_memory").inc()
            raise
        except NonFiniteOutputError:
            if not spec.probe:
                metrics.generations.labels("non_finite").inc()
            raise
        except BaseException:
            if not spec.probe:
                metrics.generations.labels("failed").inc()
            raise
        if spec.probe:
            return result
        if hasattr(result, "images_b64"):  # the answer's bulk, serialised here rather than on the event loop
            result.data_json = images_json(result.images_b64, result.sha256)
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

    return run_job


def images_json(images_b64: list[str], digests: list[str]) -> bytes:
    """The response's `data` list as JSON bytes (`ImageObject` fields), built directly: base64 text and hex digests
    need no escaping, so the multi-megabyte strings are copied once instead of validated and escaped. Each string is
    checked to need no escaping (ASCII, no quote, backslash or control character) in a few C-speed passes: a 4 MB
    image costs about 2 ms here against 9 ms with a regular expression (issue 27: it counts in every request)."""
    parts = [b"["]
    for i, (b64, digest) in enumerate(zip(images_b64, digests)):
        b64_bytes, digest_bytes = _json_safe_bytes(b64), _json_safe_bytes(digest)
        parts += [b"," if i else b"", b'{"b64_json":"', b64_bytes, b'","sha256":"', digest_bytes, b'"}']
    parts.append(b"]")
    return b"".join(parts)


def _json_safe_bytes(text: str) -> bytes:
    """`text` as ASCII bytes that a JSON string holds unescaped, or ValueError (base64 and hex digits are)."""
    data = text.encode("ascii", errors="replace")  # a non-ASCII character becomes "?", refused below
    if b"?" in data or b'"' in data or b"\\" in data or (data and int(np.frombuffer(data, np.uint8).min()) < 0x20):
        raise ValueError("images_json: base64 and hex digests only")
    return data


def response_body(response: BaseModel, data_json: bytes) -> bytes:
    """`response` (built with an empty `data` list, its first list field) as JSON bytes with `data_json` as `data`."""
    before, found, after = response.model_dump_json().encode().partition(_EMPTY_DATA)
    if not found:
        raise ValueError("response_body: the response has no empty 'data' list to fill")
    return b"".join((before, b'"data":', data_json, after))  # the image bytes copied once, on the event loop


class GenerationProbe:
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
            self._job = submit(self.queue, self.spec, bypass_capacity=True)
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


async def await_job(queue: JobQueue, job: Job, request: Request, deadline: float, settings: ServerSettings) -> Any:
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
        except GenerationOutOfMemory as exc:
            log.warning("generation ran out of device memory: %s", exc)
            raise ApiError(503, out_of_memory_message(exc), code="out_of_memory") from None
        except NonFiniteOutputError as exc:
            log.error("generation failed: %s", exc)
            raise ApiError(500, f"generation failed: {exc}", code="non_finite_output") from None
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


def out_of_memory_message(exc: GenerationOutOfMemory) -> str:
    """The 503's message: the phase, torch's detail, and what the client can do."""
    return (
        f"the server ran out of GPU memory in the {exc.phase} phase ({exc.detail}); the request's memory was "
        "released: retry later, or ask for a smaller size or fewer images"
    )


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _disconnected(request: Request) -> bool:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    return True
