"""From a parsed request to a fully resolved `GenerationSpec`: defaults filled in, every bound checked.

`resolve` raises `ApiError(400)` naming the field, the value and what is allowed; the cache overrides are validated
by the engine's own rules (`CacheConfig.merged` + the block split), so a bad request never takes a queue slot.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args, get_origin

from ..engine.policies import make_policy
from ..errors import ConfigError
from ..formatting import clip_repr
from ..settings.cache_config import CacheConfig
from ..settings.options import value_type
from .errors import ApiError
from .schemas import ImageGenerationRequest
from .settings import ServerSettings

_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*$")


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets (the served variant's preset)."""

    variant: str | None
    num_inference_steps: int
    guidance_scale: float
    width: int
    height: int
    size_multiple: int = 16  # the pipeline's own (VAE factor x patch size); sizes must also be multiples of it


@dataclass(frozen=True)
class GenerationSpec:
    prompt: str
    negative_prompt: str | None
    n: int
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    cache: CacheConfig
    """The request's settings, validated and checked against the model (`resolve`); `cache.enable_cache` says
    whether it caches. The worker runs exactly these."""
    cache_overrides: dict[str, Any] = field(default_factory=dict)
    """The `cache_dit_params` the request set (without `enable_cache`), echoed in the response."""
    variant: str | None = None
    output_format: str = "png"  # png | jpeg | webp
    output_quality: int = 100  # jpeg / webp quality in percent (OpenAI's output_compression)
    probe: bool = False  # a /health_generate check: not counted in the image and step metrics

    @property
    def enable_cache(self) -> bool:
        return self.cache.enable_cache


def parse_size(size: str | None, settings: ServerSettings, defaults: Defaults) -> tuple[int, int]:
    """'WxH' -> (width, height) within the settings' bounds; None or 'auto' -> the default size, which must be
    within them too (a model default larger than --max-side is a 400 asking for a size, not a way past the limit)."""
    lo, hi, mult = settings.min_side, settings.max_side, math.lcm(settings.size_multiple, defaults.size_multiple)
    allowed = (
        f"'WIDTHxHEIGHT' (or 'auto'), each side a multiple of {mult} between {lo} and {hi}, "
        f"at most {settings.max_pixels} pixels"
    )
    if size is None or size.strip().lower() == "auto":
        width, height = defaults.width, defaults.height
        if not _size_fits(width, height, lo, hi, mult, settings.max_pixels):
            given = "omitted" if size is None else f"{size!r}"
            raise ApiError(
                400,
                f"size is {given}, and the default size {width}x{height} is outside this server's limits: "
                f"send a size; it must be {allowed}",
                "size",
            )
        return width, height
    match = _SIZE.match(size)
    if match is None:
        raise ApiError(400, f"size={size!r} is invalid: must be {allowed}", "size")
    width, height = int(match.group(1)), int(match.group(2))
    if not (lo <= width <= hi and lo <= height <= hi) or width % mult or height % mult:
        raise ApiError(400, f"size={size!r} is invalid: must be {allowed}", "size")
    if width * height > settings.max_pixels:
        raise ApiError(400, f"size={size!r} is invalid: {width * height} pixels; must be {allowed}", "size")
    return width, height


def _size_fits(width: int, height: int, lo: int, hi: int, mult: int, max_pixels: int) -> bool:
    sides = lo <= width <= hi and lo <= height <= hi and not width % mult and not height % mult
    return sides and width * height <= max_pixels


def check_default_size(width: int, height: int, settings: ServerSettings) -> None:
    """`dicache serve --default-size` must pass the checks a request's `size` does: `ConfigError` naming the
    option, the size and what is allowed."""
    try:
        parse_size(f"{width}x{height}", settings, Defaults(None, 1, 1.0, width, height))
    except ApiError as exc:
        allowed = exc.message.partition(" is invalid: ")[2]
        raise ConfigError(f"--default-size {width}x{height} is invalid: {allowed} (server option --max-side)") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_JSON_KINDS = {
    bool: ("a JSON boolean (true or false)", lambda v: isinstance(v, bool)),
    int: ("a JSON integer", _is_int),
    float: ("a JSON number", lambda v: _is_int(v) or isinstance(v, float)),
    str: ("a JSON string", lambda v: isinstance(v, str)),
    list: (
        "a JSON list of integers (or the environment's comma-separated string)",
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(_is_int(i) for i in v)),
    ),
}
_JSON_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object"}


def _json_kind(key: str) -> tuple[str, Any]:
    """What JSON value cache setting `key` takes, in words, and its test."""
    kind = value_type(CacheConfig.model_fields[key])
    if get_origin(kind) is Annotated:
        kind = get_args(kind)[0]
    if get_origin(kind) is Literal:
        kind = type(get_args(kind)[0])
    return _JSON_KINDS[get_origin(kind) or kind]


def check_json_types(overrides: Mapping[str, Any]) -> None:
    """`cache_dit_params` values must have their setting's JSON type (`"enable_cache": "yes"` or
    `"residual_diff_threshold": "0.2"` is a 400, not converted as an environment variable's text is); null and
    unknown keys are left to the engine's own checks."""
    for key, value in overrides.items():
        if value is None or key not in CacheConfig.model_fields:
            continue
        noun, fits = _json_kind(key)
        if not fits(value):
            got = _JSON_NAMES.get(type(value), type(value).__name__)
            raise ApiError(
                400,
                f"cache_dit_params: cache override key {key!r}={clip_repr(value)} is invalid: must be {noun}, "
                f"got a {got}",
                "cache_dit_params",
            )


def effective_cache_config(overrides: Mapping[str, Any], base: CacheConfig, num_blocks: int | None) -> CacheConfig:
    """`base` with per-request `overrides`, validated exactly as the engine will (keys, values, block split) after
    `check_json_types`; a `ConfigError` becomes a 400 on `cache_dit_params`."""
    check_json_types(overrides)
    try:
        merged = base.merged(overrides)
        if num_blocks is not None:
            merged.check_block_split(num_blocks)
    except ConfigError as exc:
        raise ApiError(400, f"cache_dit_params: {exc}", "cache_dit_params") from None
    return merged


def check_step_mask(config: CacheConfig, steps: int, overrides: Mapping[str, Any]) -> None:
    """The engine's policy for `config` at `steps` must build (a step mask needs bins long enough, a preset >= 4
    steps); the 400 names `cache_dit_params` when the request set the mask, else `num_inference_steps`."""
    try:
        make_policy(config, steps)
    except ConfigError as exc:
        param = "cache_dit_params" if any(key.startswith("scm_") for key in overrides) else "num_inference_steps"
        where = "" if param == "cache_dit_params" else " (the step mask is the server's SGLANG_CACHE_DIT_SCM_* setting)"
        raise ApiError(400, f"{param}: {exc}{where}", param) from None


def resolve(
    request: ImageGenerationRequest,
    settings: ServerSettings,
    defaults: Defaults,
    base_config: CacheConfig,
    num_blocks: int | None = None,
) -> GenerationSpec:
    """Fill in defaults and check the request against the server's bounds and the engine's cache rules."""
    if request.model is not None and request.model != settings.model_id:
        raise ApiError(
            400, f"model={request.model!r} is not served here; this server serves {settings.model_id!r}", "model"
        )
    for name in ("prompt", "negative_prompt"):
        text = getattr(request, name)
        if text is not None and len(text) > settings.max_prompt_chars:
            raise ApiError(
                400,
                f"{name} is {len(text)} characters long; the limit is {settings.max_prompt_chars} "
                "(server option --max-prompt-chars)",
                name,
            )
    if request.n > settings.max_n:
        raise ApiError(400, f"n={request.n} is invalid: must be between 1 and {settings.max_n}", "n")
    width, height = parse_size(request.size, settings, defaults)
    steps = request.num_inference_steps if request.num_inference_steps is not None else defaults.num_inference_steps
    if steps > settings.max_steps:
        raise ApiError(
            400,
            f"num_inference_steps={steps} is invalid: must be between 1 and {settings.max_steps}",
            "num_inference_steps",
        )
    guidance = request.guidance_scale if request.guidance_scale is not None else defaults.guidance_scale
    overrides = dict(request.cache_dit_params or {})
    if request.enable_cache is not None:  # the top-level field wins over cache_dit_params["enable_cache"]
        overrides["enable_cache"] = request.enable_cache
    effective = effective_cache_config(overrides, base_config, num_blocks)  # default: SGLANG_CACHE_DIT_ENABLED
    overrides.pop("enable_cache", None)
    if effective.enable_cache:
        check_step_mask(effective, steps, overrides)
    return GenerationSpec(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        n=request.n,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=float(guidance),
        seed=request.seed if request.seed is not None else secrets.randbits(63),
        cache=effective,
        cache_overrides=overrides,
        variant=defaults.variant,
        output_format=request.output_format or "png",
        output_quality=100 if request.output_compression is None else request.output_compression,
    )
