"""`PipelineBackend`: runs one `GenerationSpec` on a cache-enabled Krea-2 pipeline, in the calling (worker) thread.

Each generation runs inside its own `dicache.request(pipe, config=overrides)` scope, so its cache state (residuals,
counters, statistics) lives in the worker's context and is never shared with another request; the pipeline's random
generator is seeded from the request's seed. Output images come back as base64 PNGs plus a SHA-256 of the decoded
float32 array, a bitwise fingerprint of what the model produced. A generation asked to stop (`should_stop()` true:
its client left or its time ran out) ends before its next transformer call with `GenerationStopped`.
"""

from __future__ import annotations

import base64
import contextvars
import hashlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import api as dicache_api
from ..config import CacheConfig
from ..stats import RequestStats
from .generation import Defaults, GenerationSpec


class GenerationStopped(Exception):
    """The generation was abandoned (client gone or timed out) and stopped early."""


@dataclass
class GenerationResult:
    images_b64: list[str]
    sha256: list[str]
    stats: RequestStats | None
    seconds: float


def to_float_images(images: Any) -> np.ndarray:
    """The pipeline's `output_type="np"` images as a contiguous float32 (n, H, W, C) array in [0, 1]."""
    if isinstance(images, torch.Tensor):
        images = images.detach().float().cpu().numpy()
    array = np.asarray(images, dtype=np.float32)
    return np.ascontiguousarray(array[None] if array.ndim == 3 else array)


def encode_png(image: np.ndarray) -> bytes:
    """float (H, W, C) in [0, 1] -> PNG bytes, rounded to 8 bits as the pipeline's PIL output is."""
    from PIL import Image

    pixels = (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(buffer, format="PNG")
    return buffer.getvalue()


_should_stop: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "dicache_server_should_stop", default=None
)


class PipelineBackend:
    """One pipeline, cache-enabled with `cache_config` (the environment's, read once at start-up).

    Args:
        pipe: a pipeline with the native call signature (`dicache.models.krea2.Krea2Pipeline`) and `call_scope` seam.
        cache_config: the server-wide settings; `enable_cache` is the default of requests that do not say.
        defaults: what requests that leave fields out get.
    """

    def __init__(self, pipe: Any, cache_config: CacheConfig, defaults: Defaults) -> None:
        dicache_api.enable(pipe, cache_config)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        self.pipe, self.cache_config, self.defaults = pipe, cache_config, defaults
        self.num_blocks = dicache_api.session_of(pipe).num_blocks
        self._install_stop_check()

    def _install_stop_check(self) -> None:
        """Wrap the pipeline's per-call seam (set by `dicache.enable`) to honour `should_stop` between calls."""
        inner = self.pipe.call_scope

        def call_scope(*args: Any, **kwargs: Any):
            should_stop = _should_stop.get()
            if should_stop is not None and should_stop():
                raise GenerationStopped("generation stopped: its request was abandoned")
            return inner(*args, **kwargs)

        self.pipe.call_scope = call_scope

    def generate(self, spec: GenerationSpec, should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        start = time.perf_counter()
        token = _should_stop.set(should_stop)
        try:
            with torch.inference_mode(), dicache_api.request(self.pipe, config=spec.engine_overrides()):
                output = self.pipe(
                    prompt=spec.prompt,
                    negative_prompt=spec.negative_prompt,
                    height=spec.height,
                    width=spec.width,
                    num_inference_steps=spec.num_inference_steps,
                    guidance_scale=spec.guidance_scale,
                    seed=spec.seed,
                    num_images_per_prompt=spec.n,
                    output_type="np",
                    variant=spec.variant,
                )
        finally:
            _should_stop.reset(token)
        stats = dicache_api.stats(self.pipe)  # this context's last request: the one just run
        b64, digests = [], []
        for image in to_float_images(output.images):
            digests.append(hashlib.sha256(image.tobytes()).hexdigest())
            b64.append(base64.b64encode(encode_png(image)).decode("ascii"))
        return GenerationResult(b64, digests, stats, time.perf_counter() - start)

    def close(self) -> None:
        dicache_api.disable(self.pipe)


def variant_defaults(pipe: Any, variant: str | None = None, default_size: tuple[int, int] | None = None) -> Defaults:
    """The preset of `variant` (None: the checkpoint's own, turbo if distilled) and the default (width, height)."""
    from ..models.krea2.pipeline import PRESETS

    variant = variant or ("turbo" if getattr(pipe, "is_distilled", False) else "raw")
    if variant not in PRESETS:
        raise ValueError(f"variant={variant!r} is invalid: must be one of {', '.join(PRESETS)}")
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
) -> PipelineBackend:
    """Load the native Krea-2 pipeline (`model` None: the embedded checkpoint, its Turbo student for `variant`
    "turbo"; device None: cuda if available) and
    enable caching with `cache_config` (None: the environment's, `SGLANG_CACHE_DIT_*` over the settings profile
    `profile`, default `SGLANG_CACHE_DIT_PROFILE`'s). Every request starts from these settings; its
    `cache_dit_params` merge over them."""
    from ..models.krea2 import Krea2Pipeline

    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype={dtype!r} is invalid: must be a torch dtype name such as bfloat16 or float32")
        dtype = resolved
    if cache_config is not None and profile is not None:
        raise ValueError("load_backend: pass cache_config or profile, not both")
    if cache_config is None:
        from ..profiles import cache_config as read_cache_config

        cache_config = read_cache_config(profile)
    config = cache_config
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    from ..models.krea2.pipeline import resolve_model

    pipe = Krea2Pipeline.from_pretrained(resolve_model(model, variant), dtype=dtype, device=device)
    return PipelineBackend(pipe, config, variant_defaults(pipe, variant, default_size))
