"""`PipelineBackend`: runs one `GenerationSpec` on a cache-enabled Krea-2 pipeline, phase by phase.

The phases (encode: text conditioning and starting noise; denoise; decode: VAE, pixels, image file) run on threads
of their own (`stages.GenerationStages`), so that with several requests in flight (`--workers`) one request's
encoding and decoding overlap another's denoising; an offloaded or multi-process pipeline runs them in the worker's
thread, one generation at a time. Either way a request's output is the same bytes. Each generation's denoising runs
inside its own request scope with the settings `resolve` validated (`GenerationSpec.cache`),
so its cache state (residuals, counters, statistics) lives in the worker's context and is never shared with another
request; the pipeline's random generator is seeded from the request's seed. Output images come back base64-encoded
(PNG, JPEG or WebP) plus a SHA-256 of the decoded float32 array, a bitwise fingerprint of what the model produced
whatever the encoding; the pixels are quantised on the model's device and the file is encoded once, beside the
fingerprint (another thread).

A generation asked to stop (`should_stop()` true: its client left, its time ran out or the server is shutting down)
ends with `GenerationStopped` at its next stop point: before each transformer call and each block of the
transformer and of the VAE decoder (`stop_points`), and after each denoising step, hence before the VAE decode (the
pipeline's `callback_on_step_end`). Both are declared seams, so `dicache.enable` / `disable` on the pipeline leave
them in place. The worker is therefore busy at most one block longer than the request (one transformer call when
the blocks are compiled).

Faults (`docs/reliability.md`): a CUDA out-of-memory error inside a phase ends the generation with
`GenerationOutOfMemory(phase)`, raised only once the request's memory is released: the error's traceback frames are
cleared (they hold the phase's tensors), reference cycles collected and the allocator's cache emptied, so the next
request finds the memory it had before. Images whose latents or decoded pixels are not finite are never encoded:
the decode phase checks them, one reduction per image and no extra host wait, and raises `NonFiniteOutputError`.
"""

from __future__ import annotations

import base64
import contextvars
import gc
import hashlib
import io
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from .. import api as dicache_api
from ..engine.policies.step_mask import MIN_PRESET_STEPS
from ..engine.reduction import PARALLEL_LAYOUT_ATTR
from ..engine.stats import RequestStats
from ..models import artifact_bytecode, startup_files
from ..models.compile_artifact import (
    ArtifactKey,
    compile_counters,
    compile_event_count,
    compile_events,
    compile_time_spent,
    compile_time_totals,
    load_artifact,
    save_artifact,
)
from ..models.krea2 import Krea2Pipeline
from ..models.krea2.checkpoints import resolve_model
from ..models.krea2.latents import check_finite, finite_per_image
from ..models.krea2.presets import PRESETS, resolve_variant
from ..offload.settings import OffloadLimits, OffloadSettings
from ..settings.cache_config import CacheConfig
from ..settings.devices import resolve_device
from ..settings.profiles import cache_config as read_cache_config
from ..sweep.flops import request_flops
from . import png
from .gc_pauses import freeze_start_up_objects
from .generation import Defaults, GenerationSpec
from .memory import release_cached_memory
from .stages import GenerationStages, inline
from .startup import StartupTimeline
from .stop_points import install_stop_points
from .text_lengths import TextLengthPreparation

log = logging.getLogger("dicache.server")


class GenerationStopped(Exception):
    """The generation was abandoned (client gone or timed out) and stopped early."""


class GenerationOutOfMemory(Exception):
    """The device ran out of memory in the generation's `phase` ("encode", "denoise" or "decode"); the request's
    memory was released before this was raised, and it holds no reference to the request's tensors. `detail`: the
    first line of torch's message (what it tried to allocate)."""

    def __init__(self, phase: str, detail: str) -> None:
        self.phase, self.detail = phase, detail
        super().__init__(f"out of device memory in the {phase} phase: {detail}")


@dataclass
class GenerationResult:
    """`seconds`: the whole generation (waits for busy phases included); `flops`: estimated FLOPs of the transformer
    work done (None when the model's config does not allow it); `phases`: seconds per phase, each with its GPU work
    finished and without waits for a busy phase: `encode`, `denoise`, `decode` (VAE and pixels) and `image` (image
    file, fingerprint and base64)."""

    images_b64: list[str]
    sha256: list[str]
    stats: RequestStats | None
    seconds: float
    flops: float | None = None
    phases: dict[str, float] | None = None

    @property
    def pipeline_s(self) -> float:
        """Seconds inside the model's phases (text encoding, denoising, VAE decoding): waits and the image file
        excluded; 0 when not measured."""
        return sum(self.phases[name] for name in ("encode", "denoise", "decode")) if self.phases else 0.0


def _seconds_since(start: float, output: torch.Tensor) -> float:
    """Seconds since `start` (`time.perf_counter`) once the work queued on the current stream of `output`'s CUDA
    device is done (the phase's stream waits for it anyway before handing `output` on)."""
    if output.device.type == "cuda":
        torch.cuda.current_stream(output.device).synchronize()
    return time.perf_counter() - start


def to_float_images(images: Any) -> np.ndarray:
    """The pipeline's `output_type="np"` images as a contiguous float32 (n, H, W, C) array in [0, 1]."""
    if isinstance(images, torch.Tensor):
        images = images.detach().float().cpu().numpy()
    array = np.asarray(images, dtype=np.float32)
    return np.ascontiguousarray(array[None] if array.ndim == 3 else array)


_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
PNG_COMPRESS_LEVEL = 1
"""zlib level of the PNG files served: 1 encodes several times faster than the usual 6 for files about a tenth
larger; PNG is lossless at every level (the pixels are the same)."""


def quantize_pixels(images: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """float images in [0, 1] -> uint8, rounded half to even as the pipeline's PIL output is (`round(clip(x) · 255)`);
    the same arithmetic on a numpy array or a tensor on any device gives the same bytes."""
    if isinstance(images, torch.Tensor):
        return (images.clamp(0.0, 1.0) * 255).round().to(torch.uint8)
    return (np.clip(images, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_pixels(pixels: np.ndarray, output_format: str = "png", quality: int = 100) -> bytes:
    """uint8 (H, W, C) -> image file bytes. `output_format`: png (lossless; `quality` unused), jpeg or webp
    (`quality` in percent, 0..100)."""
    if output_format not in _PIL_FORMATS:
        raise ValueError(f"output_format={output_format!r} is invalid: must be one of {', '.join(_PIL_FORMATS)}")
    if output_format == "png":  # dicache.server.png: faster than Pillow (its module docstring: how much)
        return png.encode_png(pixels, PNG_COMPRESS_LEVEL)
    buffer = io.BytesIO()
    Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(
        buffer, format=_PIL_FORMATS[output_format], quality=int(quality)
    )
    return buffer.getvalue()


def encode_image(image: np.ndarray, output_format: str = "png", quality: int = 100) -> bytes:
    """float (H, W, C) in [0, 1] -> image bytes, rounded to 8 bits as the pipeline's PIL output is."""
    return encode_pixels(quantize_pixels(image), output_format, quality)


def encode_png(image: np.ndarray) -> bytes:
    """float (H, W, C) in [0, 1] -> PNG bytes."""
    return encode_image(image, "png")


def host_images(images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The pipeline's `output_type="pt"` images `(n, 3, H, W)` in [0, 1] -> `(floats, pixels)` on the host: the
    float32 `(n, H, W, 3)` array the fingerprint is taken of and its uint8 pixels, quantised on the images' device
    (a quarter of the bytes to copy, no float temporaries on the host)."""
    hwc = images.detach().float().permute(0, 2, 3, 1).contiguous()
    return hwc.cpu().numpy(), quantize_pixels(hwc).cpu().numpy()


_should_stop: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "dicache_server_should_stop", default=None
)


def image_answers(
    floats: np.ndarray, pixels: np.ndarray, output_format: str, quality: int, digests: ThreadPoolExecutor
) -> tuple[list[str], list[str]]:
    """The image phase's host work: float32 `(n, H, W, C)` images and their uint8 pixels -> (each image file in
    base64, each float image's SHA-256 hex digest). The digests are taken on `digests` (a thread) while the files
    are written. Each string is `base64.b64encode(encode_pixels(image, output_format, quality))` in ASCII; a PNG's
    base64 is done band by band on the PNG writer's threads (`png.encode_png_base64`), not after the file."""
    fingerprints = digests.submit(lambda: [hashlib.sha256(image).hexdigest() for image in floats])
    files = [_file_base64(image, output_format, quality) for image in pixels]
    return files, fingerprints.result()


def _file_base64(pixels: np.ndarray, output_format: str, quality: int) -> str:
    """`encode_pixels`' file in base64 (ASCII)."""
    if output_format == "png":
        return png.encode_png_base64(pixels, PNG_COMPRESS_LEVEL)
    return base64.b64encode(encode_pixels(pixels, output_format, quality)).decode("ascii")


@dataclass
class _Encoded:
    """What the encode phase hands to the denoise phase."""

    plan: Any
    cond: Any
    uncond: Any
    latents: torch.Tensor
    seconds: float

    @property
    def text_tokens(self) -> dict[str, int]:
        """Real text tokens per branch: the conditioning keeps only them (one prompt per request, so no padding)."""
        branches = {"cond": self.cond, "uncond": self.uncond}
        return {name: int(c.num_tokens) for name, c in branches.items() if c is not None}


class PipelineBackend:
    """One pipeline, cache-enabled with `cache_config` (the environment's, read once at start-up).

    Args:
        pipe: a pipeline with the native call signature and phases (`dicache.models.krea2.Krea2Pipeline`:
            `plan_call`, `condition`, `starting_latents`, `run_denoise`, `decode`), including its
            `callback_on_step_end`.
        cache_config: the server-wide settings; `enable_cache` is the default of requests that do not say.
        defaults: what requests that leave fields out get.
        staged: run the phases on their own threads and CUDA streams (`stages.GenerationStages`), so that requests
            in flight overlap; None decides at the first generation: staged unless the pipeline is offloaded or split
            over processes (then the phases run in the worker's thread, one generation at a time).
    """

    def __init__(self, pipe: Any, cache_config: CacheConfig, defaults: Defaults, staged: bool | None = None) -> None:
        dicache_api.enable(pipe, cache_config)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        self.pipe, self.cache_config, self.defaults = pipe, cache_config, defaults
        self.num_blocks = dicache_api.session_of(pipe).num_blocks
        self.staged = staged
        self._stages: GenerationStages | None = None
        self._stages_lock = threading.Lock()
        self._one_at_a_time = threading.Lock()  # the unstaged mode runs whole generations one by one
        self._in_flight, self._in_flight_lock = 0, threading.Lock()
        self.text_lengths: TextLengthPreparation | None = None  # `prepare_text_lengths(background=True)`
        self.lengths_met: set[int] = set()  # prompt lengths the warm-up met on the denoise thread, default size
        self._plan_stand_ins: dict[int, int] = {}  # prompt length -> the length the preparation meets for its plan
        self._plan_counts: dict[str, int] | None = None  # the background preparation's prompt lengths and plans met
        self.startup: dict[str, Any] | None = None  # `ready_to_serve`'s phases
        self.bytecode_writer: Any = None  # `ready_to_serve`'s subprocess writing the store's bytecode, if any
        self._digests = ThreadPoolExecutor(1, thread_name_prefix="dicache-digest")
        self._install_stop_checks()

    def _install_stop_checks(self) -> None:
        """Honour `should_stop` before each transformer call and each block of the transformer and the VAE decoder
        (`stop_points`: forward pre-hooks, untouched by `dicache.enable` / `disable`); the pipeline's declared
        `callback_on_step_end` seam adds a check after each step, so that the VAE decode does not start."""
        self.stop_points = install_stop_points(
            (getattr(self.pipe, "transformer", None), getattr(self.pipe, "vae", None)), _check_stop
        )

    def stages(self) -> GenerationStages | None:
        """The phase threads (created at the first call), or None in the unstaged mode."""
        with self._stages_lock:
            if self.staged is None:
                self.staged = can_stage(self.pipe)
            if self.staged and self._stages is None:
                self._stages = GenerationStages(self.pipe.device)
            return self._stages

    def generate(self, spec: GenerationSpec, should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        """Run `spec`'s phases. Raises `GenerationStopped` (stopped early), `GenerationOutOfMemory` (its memory
        released first), `NonFiniteOutputError` (no image encoded), or the pipeline's error."""
        start = time.perf_counter()
        token = _should_stop.set(should_stop)
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            _check_stop()  # abandoned while it waited for this worker
            stages = self.stages()
            if stages is None:
                with self._one_at_a_time:
                    return self._phases(spec, inline, start)
            return self._phases(spec, stages.run, start)
        except GenerationOutOfMemory as exc:
            failure = GenerationOutOfMemory(exc.phase, exc.detail)
            traceback.clear_frames(exc.__traceback__)  # `_phases`' frame holds the earlier phases' outputs
        finally:
            _should_stop.reset(token)
            with self._in_flight_lock:
                self._in_flight -= 1
        release_after_oom(self.pipe.device)
        raise failure  # a fresh exception: its traceback starts here and holds no tensor

    def _phases(self, spec: GenerationSpec, run: Callable[..., Any], start: float) -> GenerationResult:
        self._meet_lengths_ahead(spec)
        run = self._releasing_on_oom(run)
        encoded = run("encode", self._encode, spec)
        latents, stats, denoise_s = run("denoise", self._denoise, spec, encoded)
        images_b64, digests, decode_s, image_s = run("decode", self._decode, spec, encoded.plan, latents)
        flops = self.estimate_flops(spec, stats, encoded.text_tokens)
        phases = {"encode": encoded.seconds, "denoise": denoise_s, "decode": decode_s, "image": image_s}
        return GenerationResult(images_b64, digests, stats, time.perf_counter() - start, flops, phases)

    def _releasing_on_oom(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """`run` (`stages.run` or `inline`) turning a CUDA out-of-memory error of the phase into
        `GenerationOutOfMemory(phase)` (`generate` releases the memory)."""

        def guarded(phase: str, fn: Callable[..., Any], *args: Any) -> Any:
            try:
                return run(phase, fn, *args)
            except RuntimeError as exc:
                if not is_out_of_memory(exc):
                    raise
                detail = (str(exc).strip().splitlines() or ["(no message)"])[0]
                traceback.clear_frames(exc.__traceback__)  # the finished frames hold the phase's tensors
            raise GenerationOutOfMemory(phase, detail)  # outside the handler: no __context__ holding the frames

        return guarded

    def _plan(self, spec: GenerationSpec) -> Any:
        """The pipeline's plan of `spec`'s call (one prompt)."""
        return self.pipe.plan_call(
            1, spec.height, spec.width, spec.num_inference_steps, spec.guidance_scale, spec.n, "pt", spec.variant
        )

    def _encode(self, spec: GenerationSpec) -> _Encoded:
        """Phase 1: the call's plan, its text conditioning and its starting noise (seeded on the CPU)."""
        start = time.perf_counter()
        plan = self._plan(spec)
        cond, uncond = self.pipe.condition(plan, [spec.prompt], spec.negative_prompt)
        latents = self.pipe.starting_latents(plan, seed=spec.seed)
        return _Encoded(plan, cond, uncond, latents, _seconds_since(start, latents))

    def _denoise(self, spec: GenerationSpec, encoded: _Encoded) -> tuple[torch.Tensor, RequestStats | None, float]:
        """Phase 2: the denoising loop in the request's cache scope (`spec.cache`, checked by `resolve`); returns the
        latents and the request's cache statistics."""
        _check_stop()
        start = time.perf_counter()
        prepare_compiled_thread(self.pipe)
        # the pipeline's current session (a later `dicache.enable` replaces it); the config was checked by `resolve`
        session = dicache_api.session_of(self.pipe)
        with session.request(config=spec.cache):
            latents = self.pipe.run_denoise(
                encoded.plan, encoded.cond, encoded.uncond, encoded.latents, callback_on_step_end=_stop_after_step
            )
        stats = dicache_api.stats(self.pipe)  # this context's last request: the one just run
        return latents, stats, _seconds_since(start, latents)

    def _decode(
        self, spec: GenerationSpec, plan: Any, latents: torch.Tensor
    ) -> tuple[list[str], list[str], float, float]:
        """Phase 3: VAE decode, pixels quantised on the device, the fingerprint (another thread) and the image files
        in base64; returns those, the fingerprints, and the seconds of the decode and of the image files."""
        _check_stop()
        start = time.perf_counter()
        images = self.pipe.decode(latents, plan.height, plan.width, "pt")
        finite = finite_per_image(latents, images)  # queued; read once host_images has waited for the device
        floats, pixels = host_images(images)
        decode_s = time.perf_counter() - start
        check_finite(finite)  # NonFiniteOutputError: no image of this request is encoded or returned
        b64, digests = image_answers(floats, pixels, spec.output_format, spec.output_quality, self._digests)
        return b64, digests, decode_s, time.perf_counter() - start - decode_s

    def estimate_flops(
        self, spec: GenerationSpec, stats: RequestStats | None, tokens: dict[str, int] | None = None
    ) -> float | None:
        """FLOPs of the transformer work `stats` records (`dicache.sweep.flops`), of the whole model (all ranks
        together when it is split over GPUs); None if the model has no Krea-2 config or text encoder to count with.
        `tokens`: the real text tokens per branch when known (the encode phase's), else the prompts are tokenized."""
        config = getattr(getattr(self.pipe, "transformer", None), "config", None)
        encoder = getattr(self.pipe, "text_encoder", None)
        if stats is None or config is None or encoder is None or not hasattr(encoder, "num_valid_tokens"):
            return None
        rows, cols = self.pipe.latent_grid(spec.height, spec.width)
        if tokens is None:
            prompts = {"cond": spec.prompt}
            if "uncond" in stats.branches:
                prompts["uncond"] = spec.negative_prompt or ""
            tokens = {name: int(encoder.num_valid_tokens(text)[0]) for name, text in prompts.items()}
        branches = {name: (len(b.computed_steps), len(b.cached_steps)) for name, b in stats.branches.items()}
        try:
            return request_flops(
                config, rows * cols, tokens, branches, (stats.num_blocks, stats.fn_blocks + stats.bn_blocks), spec.n
            )
        except (ValueError, TypeError):
            return None

    WARM_UP_STEPS = MIN_PRESET_STEPS
    """Steps of each warm-up generation: the fewest a step-mask preset takes (a server may be configured with one);
    the first step is computed (the cache's warm-up step), the rest computed or cached. No graph depends on the step
    count, so more steps would only take longer."""
    UNCACHED_WARM_UP_STEPS = 2
    """Steps of each uncached warm-up generation (no step mask applies to it): every step computes the same graphs,
    the first call compiles them and the second runs them as requests do; more steps add only time (a full-size step,
    and twice that for Raw's guided steps)."""
    WARM_UP_PROMPTS = ("warm-up", "a longer warm-up prompt, so that the text length differs from the first one")

    def warm_up(self, steps: int = WARM_UP_STEPS) -> dict[str, Any]:
        """Compile-time warm-up before serving: at the default size, one uncached and one cached generation of
        each variant, with prompts of two lengths, so that every graph a request can need (computed and cached
        steps, cond and uncond, a symbolic text length) is built before the first request; `steps` steps cached,
        `UNCACHED_WARM_UP_STEPS` at most uncached. Returns what ran: generations, seconds, torch.compile's counters
        over the warm-up (graphs compiled, compile-cache hits and misses: `compile_artifact.compile_counters`), each
        compiled frame's seconds (`compile_events`), the compile steps that took longest (`compile_time_spent`), and
        per generation (`runs`): its variant, whether caching was on, its steps and seconds, its phases' seconds and
        the graphs it compiled."""
        start = time.perf_counter()
        before, events, timed = compile_counters(), compile_event_count(), compile_time_totals()
        runs = []
        for variant, preset in PRESETS.items():
            for prompt, enable_cache in zip(self.WARM_UP_PROMPTS, (False, True)):
                spec = GenerationSpec(
                    prompt=prompt,
                    negative_prompt=None,
                    n=1,
                    width=self.defaults.width,
                    height=self.defaults.height,
                    num_inference_steps=steps if enable_cache else min(steps, self.UNCACHED_WARM_UP_STEPS),
                    guidance_scale=float(preset.guidance_scale),
                    seed=0,
                    cache=self.cache_config.merged(
                        {"enable_cache": True, "max_warmup_steps": 1} if enable_cache else {"enable_cache": False}
                    ),
                    variant=variant,
                )
                graphs = compile_counters()["graphs"]
                result = self.generate(spec)
                runs.append(
                    {
                        "variant": variant,
                        "cache": enable_cache,
                        "steps": spec.num_inference_steps,
                        "seconds": round(result.seconds, 2),
                        "phases": {name: round(seconds, 2) for name, seconds in (result.phases or {}).items()},
                        "graphs_compiled": compile_counters()["graphs"] - graphs,
                    }
                )
        release_cached_memory(self.pipe.device)  # the warm-up's Raw requests need more than a Turbo server keeps
        encoder = getattr(self.pipe, "text_encoder", None)
        if hasattr(encoder, "num_valid_tokens"):  # their attention plans are built on the denoise thread now
            self.lengths_met.update(int(n) for n in encoder.num_valid_tokens(list(self.WARM_UP_PROMPTS)))
        after = compile_counters()
        return {
            "generations": len(runs),
            "seconds": round(time.perf_counter() - start, 2),
            "graphs_compiled": after["graphs"] - before["graphs"],
            "compile_caches": {name: after[name] - before[name] for name in after if name != "graphs"},
            "compiles": compile_events(events),
            "compile_time_s": compile_time_spent(timed),
            "runs": runs,
        }

    def warm_up_shapes(self, steps: int = WARM_UP_STEPS) -> dict[str, Any]:
        """What `warm_up` compiles for, as the compile artifact's key takes it (`Krea2Pipeline.compile_key`): the
        default size, steps, variants (steps are the warm-up's, guidance the presets'), prompts and images per
        request, and the processes the model is split over."""
        return {
            "size": [self.defaults.width, self.defaults.height],
            "steps": steps,
            "uncached_steps": min(steps, self.UNCACHED_WARM_UP_STEPS),
            "guidance": {variant: float(preset.guidance_scale) for variant, preset in PRESETS.items()},
            "prompt_lengths": len(self.WARM_UP_PROMPTS),
            "images": 1,
            "ranks": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        }

    def compile_key(self) -> ArtifactKey:
        """The key of this backend's compile artifact: the pipeline's (`compile_key`) for `warm_up_shapes`."""
        return self.pipe.compile_key(self.warm_up_shapes())

    def busy(self) -> bool:
        """Whether a generation is in flight (from the worker's call of `generate` until it returns)."""
        with self._in_flight_lock:
            return self._in_flight > 0

    def prepare_text_lengths(self, background: bool = False, **preparation: Any) -> dict[str, Any]:
        """Every prompt length's attention plan met once at the default size (`pipe.prepare_text_lengths`) on the
        denoise phase's thread, where requests meet them, so that a prompt of a length the server has not seen costs
        no attention set-up (cuDNN's plan per shape and thread: 50-75 ms per new plan). One length is met per plan,
        none for a plan the warm-up met (`text_lengths_to_meet`: with shared plans one length stands for every one at
        1024², and the warm-up met it). Only on CUDA with the phases staged (offloaded and split pipelines run
        elsewhere); returns {} where skipped.

        At once (returns the lengths met and seconds), or with `background` between requests
        (`text_lengths.TextLengthPreparation`, its keyword arguments in `preparation`: a chunk at a time while no
        generation is in flight; none when no plan is left to meet); returns how many lengths it will meet and how
        many prompt lengths their plans serve, and `text_lengths` shows its progress."""
        stages = self.stages()
        if stages is None or self.pipe.device.type != "cuda" or not hasattr(self.pipe, "prepare_text_lengths"):
            return {}
        size = (self.defaults.height, self.defaults.width)
        lengths, stand_ins, planned = self.text_lengths_to_meet()

        def prepare(chosen: Sequence[int]) -> int:  # returns once the GPU is done
            return stages.run("denoise", lambda: self.pipe.prepare_text_lengths(*size, lengths=chosen))

        if background:
            self._plan_counts = {name: planned[name] for name in ("prompt_lengths", "plans_met")}
            if lengths:
                self._plan_stand_ins = stand_ins
                self.text_lengths = TextLengthPreparation(prepare, lengths, self.busy, **preparation)
                self.text_lengths.start()
            return {**planned, "background": bool(lengths)}
        start = time.perf_counter()
        prepare(lengths)
        return {**planned, "seconds": round(time.perf_counter() - start, 2)}

    def text_lengths_to_meet(self) -> tuple[list[int], dict[int, int], dict[str, int]]:
        """What `prepare_text_lengths` meets at the default size: the stand-in lengths of the attention plans the
        warm-up did not meet, longest first; every prompt length's stand-in (`pipe.attention_plan_lengths`); and the
        counts `/v1/server_info` shows (lengths to meet, prompt lengths, plans the warm-up met)."""
        stand_ins = self.pipe.attention_plan_lengths(self.defaults.height, self.defaults.width)
        met = {stand_ins[n] for n in self.lengths_met if n in stand_ins}
        lengths = sorted(set(stand_ins.values()) - met, reverse=True)
        return lengths, stand_ins, {"lengths": len(lengths), "prompt_lengths": len(stand_ins), "plans_met": len(met)}

    def _meet_lengths_ahead(self, spec: GenerationSpec) -> None:
        """While the background preparation runs (`prepare_text_lengths(background=True)`): the request's prompt
        lengths (its prompt's, and its negative prompt's with CFG) whose plans are not met yet are queued on the
        denoise thread now (each plan's stand-in length), so that they are met while the prompt is encoded rather than
        in the request's denoising. Only for the shape the preparation meets (the default size, one image); a failure
        is logged and leaves the length to the request."""
        preparation, stages = self.text_lengths, self._stages
        if preparation is None or stages is None or spec.n != 1:
            return
        if (spec.height, spec.width) != (self.defaults.height, self.defaults.width):
            return
        prompts = [spec.prompt] + ([spec.negative_prompt or ""] if self._plan(spec).cfg else [])
        own = self.pipe.text_encoder.num_valid_tokens(prompts)
        lengths = preparation.claim(self._plan_stand_ins.get(int(n), int(n)) for n in own)
        if not lengths:
            return
        size = (self.defaults.height, self.defaults.width)

        def meet() -> None:
            try:
                self.pipe.prepare_text_lengths(*size, lengths=lengths)
            except Exception:  # the request meets them itself, as with no preparation
                log.exception("meeting prompt lengths %s ahead of a request failed", lengths)

        stages.submit("denoise", meet)

    def startup_report(self) -> dict[str, Any] | None:
        """`startup` (the phases `ready_to_serve` recorded) with the background preparation's progress now: lengths
        met (of those to meet), the prompt lengths their plans serve and the plans the warm-up met."""
        report, counts = self.startup, self._plan_counts or {}
        if report is not None and self.text_lengths is not None:
            return {**report, "text_lengths": {**self.text_lengths.progress(), **counts}}
        if report is not None and counts:  # none to meet: the warm-up met every plan
            return {**report, "text_lengths": {"lengths": 0, "of": 0, **counts, "state": "done"}}
        return report

    def close(self) -> None:
        if self.text_lengths is not None:
            self.text_lengths.close()
        if self._stages is not None:
            self._stages.close()
        self._digests.shutdown(wait=True)
        self.stop_points.remove()
        dicache_api.disable(self.pipe)


def can_stage(pipe: Any) -> bool:
    """Whether `pipe`'s phases may run on threads of their own: it has them, and none of its weights move between
    phases (offload) or wait on other processes (a model split by `dicache.parallel`)."""
    transformer = getattr(pipe, "transformer", None)
    has_phases = all(hasattr(pipe, name) for name in ("plan_call", "condition", "starting_latents", "run_denoise"))
    return has_phases and getattr(pipe, "offload", None) is None and not hasattr(transformer, PARALLEL_LAYOUT_ATTR)


_OUT_OF_MEMORY = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
"""Messages of device allocation failures raised as a plain RuntimeError (a library's own allocation, or the CUDA
runtime's `cudaErrorMemoryAllocation`) rather than torch's `OutOfMemoryError` (the caching allocator's)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a device running out of memory: torch's `OutOfMemoryError`, or a RuntimeError saying so."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and any(text in message for text in _OUT_OF_MEMORY)


def release_after_oom(device: Any) -> None:
    """After a failed request: collect the reference cycles its exception left (frames, futures), then hand the
    allocator's cached blocks back to the driver, so that fragmentation from the failed allocation does not make the
    next request fail too. The other requests in flight keep their memory; no-op off CUDA but the collection."""
    gc.collect()
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def prepare_compiled_thread(pipe: Any) -> None:
    """Apply the compiled transformer's torch.compile settings in this thread (they are per thread from torch 2.12
    on: a worker would otherwise recompile under the default limits)."""
    apply = getattr(getattr(pipe, "transformer", None), "apply_compile_settings", None)
    if apply is not None:
        apply()


def _check_stop() -> None:
    """Raise `GenerationStopped` if this worker's current generation should stop."""
    should_stop = _should_stop.get()
    if should_stop is not None and should_stop():
        raise GenerationStopped("generation stopped: its request was abandoned")


def _stop_after_step(pipe: Any, step: int, timestep: Any, tensors: dict) -> dict:
    """`callback_on_step_end`: stop between steps, and before the VAE decode after the last one."""
    _check_stop()
    return {}


def variant_defaults(pipe: Any, variant: str | None = None, default_size: tuple[int, int] | None = None) -> Defaults:
    """The preset of `variant` (None: the checkpoint's own, turbo if distilled) and the default (width, height)."""
    variant = resolve_variant(pipe, variant)
    preset = PRESETS[variant]
    if default_size is None:
        height, width = getattr(pipe, "default_size", (1024, 1024))
        default_size = (int(width), int(height))
    return Defaults(
        variant=variant,
        num_inference_steps=preset.num_inference_steps,
        guidance_scale=float(preset.guidance_scale),
        width=default_size[0],
        height=default_size[1],
        size_multiple=int(getattr(pipe, "size_multiple", 16)),
    )


def load_backend(
    model: str | None = None,
    variant: str | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | None = None,
    cache_config: CacheConfig | None = None,
    default_size: tuple[int, int] | None = None,
    profile: str | None = None,
    load_format: str = "auto",
    offload: OffloadSettings | None = None,
    offload_limits: OffloadLimits | None = None,
    quantization: Any = None,
    text_encoder_quantization: str | None = None,
    compile: bool = False,
    weight_store: str | os.PathLike | None = None,
) -> PipelineBackend:
    """Load the native Krea-2 pipeline (`model` None: the embedded checkpoint, its Turbo student for `variant`
    "turbo"; device None: cuda if available) and
    enable caching with `cache_config` (None: the environment's, `SGLANG_CACHE_DIT_*` over the settings profile
    `profile`, default `SGLANG_CACHE_DIT_PROFILE`'s). Every request starts from these settings; its
    `cache_dit_params` merge over them. `offload` / `offload_limits`: the memory options and the largest request
    their plan holds. `quantization` / `text_encoder_quantization` / `compile` are applied while loading, in
    `Krea2Pipeline.from_pretrained`'s order: quantize (each block as it is read), plan and place (with offload),
    compile. `weight_store`: where the quantised transformer is kept and found (`Krea2Pipeline.from_pretrained`)."""
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype={dtype!r} is invalid: must be a torch dtype name such as bfloat16 or float32")
        dtype = resolved
    if cache_config is not None and profile is not None:
        raise ValueError("load_backend: pass cache_config or profile, not both")
    if cache_config is None:
        cache_config = read_cache_config(profile)
    config = cache_config
    device = str(resolve_device(device, "device"))

    pipe = Krea2Pipeline.from_pretrained(
        resolve_model(model, variant),
        dtype=dtype,
        device=device,
        load_format=load_format,
        quantization=quantization,
        text_encoder_quantization=text_encoder_quantization,
        compile=compile,
        offload_settings=offload,
        offload_limits=offload_limits,
        weight_store=weight_store,
        cache_config=config,
    )
    release_cached_memory(pipe.device)  # what loading left reserved (e.g. bf16 weights replaced by FP8 ones)
    return PipelineBackend(pipe, config, variant_defaults(pipe, variant, default_size))


def ready_to_serve(
    backend: PipelineBackend,
    *,
    warm_up: bool,
    prepare_text_lengths: str,
    report: Callable[[str], None],
    compile_artifact: str | os.PathLike | None = None,
    timeline: StartupTimeline | None = None,
) -> None:
    """The last start-up steps of a loaded (quantised, compiled, split) backend, the same in `dicache serve` and in
    each Ray Serve replica: with `warm_up`, the warm-up generations (compiling, so the first request is not the slow
    one); `prepare_text_lengths` (`settings.TEXT_LENGTH_MODES`): "before-ready", every prompt length met once (after
    the warm-up: the compiled blocks then take any length); then the allocator's unused blocks handed back and the
    peak counters reset (what quantisation and the warm-up left reserved: the serving peak starts here), and every
    object alive frozen for the garbage collector (`gc_pauses`); "background": the lengths met after that, between
    requests (`PipelineBackend.prepare_text_lengths`). `report` gets one line per step that did something, and one
    with the start-up's phases.

    `compile_artifact`: a compile-artifact store (`dicache.models.compile_artifact`, `--compile-artifact`). With
    `warm_up`, the artifact of this backend's key (`PipelineBackend.compile_key`) is put into the compile caches
    before the warm-up, so that the warm-up compiles from them; when there was none, the caches are saved to the
    store after the warm-up (when it can be written); the list of the code files this start read goes there too
    unless one is there (`startup_files.record`: the next start's prefetch reads them ahead), and a subprocess compiles
    the bytecode of its modules there (`artifact_bytecode`: the next start compiles no source). Each outcome is one log
    line; a missing, foreign or unreadable artifact never stops the start. `timeline`: where the phases are recorded
    (`startup.StartupTimeline`; default a new one); the result is `backend.startup`, which `/v1/server_info`
    shows."""
    timeline = timeline if timeline is not None else StartupTimeline()
    store, key, loaded = None, None, None
    if warm_up and compile_artifact is not None:
        store, key = compile_artifact, backend.compile_key()
        with timeline.phase("compile_artifact"):
            loaded = load_artifact(store, key)
        timeline.details["compile_artifact"] = loaded.to_dict()
    if warm_up:
        with timeline.phase("warm_up"):
            result = backend.warm_up()
        timeline.details["warm_up"] = result
        report(f"warm-up (compile): {result}")
    if prepare_text_lengths == "before-ready":
        with timeline.phase("text_lengths"):
            prepared = backend.prepare_text_lengths()
        if prepared:
            report(f"prompt lengths prepared: {prepared}")
    if key is not None and loaded.status != "loaded":
        notes = {"warm_up": timeline.details.get("warm_up", {}).get("seconds"), "shapes": backend.warm_up_shapes()}
        with timeline.phase("artifact_save"):
            saved = save_artifact(store, key, notes)
        timeline.details["compile_artifact_saved"] = saved.to_dict()
    if store is not None:  # the code this start read, for the next start's prefetch to read ahead
        timeline.details["startup_files"] = startup_files.record(store)
        backend.bytecode_writer = artifact_bytecode.write_in_background(store)
    release_cached_memory(backend.pipe.device)
    freeze_start_up_objects()
    backend.startup = timeline.to_dict()
    report(timeline.line())
    if prepare_text_lengths == "background":  # after the report: ready means serving; the lengths follow

        def finished(progress: dict[str, Any]) -> None:
            report(f"prompt lengths prepared in the background: {progress}")

        planned = backend.prepare_text_lengths(background=True, on_done=finished)
        if planned.get("background"):
            report(f"preparing prompt lengths in the background, between requests: {planned}")
        elif planned:
            report(f"prompt lengths: every attention plan met by the warm-up: {planned}")
