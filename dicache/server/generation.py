"""From a parsed request to a fully resolved `GenerationSpec`: defaults filled in, every bound checked.

`resolve` raises `ApiError(400)` naming the field, the value and what is allowed; the cache overrides are validated
by the engine's own rules (`CacheConfig.merged` + the block split), so a bad request never takes a queue slot.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args, get_origin

from ..engine.policies import make_policy
from ..errors import ConfigError
from ..formatting import clip_repr
from ..settings.cache_config import SETTINGS_BY_KEY, CacheConfig
from ..settings.options import value_type
from .errors import ApiError
from .schemas import ImageGenerationRequest, integral
from .settings import ServerSettings


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


@dataclass(frozen=True)
class SizeRule:
    """The sizes a server takes, declared once: 'WIDTHxHEIGHT' in plain digits, each side a multiple of `multiple`
    between `lo` and `hi`, or 'auto' (or no size) for the default size when it is within them. `form` is the one
    regular expression for both: `parse_size` matches requests against it, and /openapi.json states it as the
    `size` pattern (the two cannot disagree)."""

    lo: int
    hi: int
    multiple: int
    default: tuple[int, int]

    @classmethod
    def of(cls, settings: ServerSettings, defaults: Defaults) -> SizeRule:
        multiple = math.lcm(settings.size_multiple, defaults.size_multiple)
        return cls(settings.min_side, settings.max_side, multiple, (defaults.width, defaults.height))

    @property
    def sides(self) -> range:
        """Every allowed side length, in pixels."""
        return range(-(-self.lo // self.multiple) * self.multiple, self.hi + 1, self.multiple)

    def fits(self, width: int, height: int) -> bool:
        return width in self.sides and height in self.sides

    @property
    def form(self) -> str:
        """'WIDTHxHEIGHT' as a regular expression (Python's and ECMA-262's alike), a group per side."""
        sides = "|".join(str(side) for side in self.sides)
        return f"({sides})x({sides})"

    @property
    def pattern(self) -> str:
        """The anchored pattern of `size` in /openapi.json: `form`, and 'auto' when the default size fits."""
        return f"^(?:auto|{self.form})$" if self.fits(*self.default) else f"^(?:{self.form})$"

    @property
    def allowed(self) -> str:
        auto = " (or 'auto')" if self.fits(*self.default) else ""
        return f"'WIDTHxHEIGHT'{auto}, each side a multiple of {self.multiple} between {self.lo} and {self.hi}"


def parse_size(size: str | None, settings: ServerSettings, defaults: Defaults) -> tuple[int, int]:
    """'WxH' -> (width, height) as `SizeRule.form` allows; None or 'auto' -> the default size, which must be
    within the bounds too (a model default larger than --max-side is a 400 asking for a size, not a way past the
    limit)."""
    rule = SizeRule.of(settings, defaults)
    if size is None or size == "auto":
        if not rule.fits(*rule.default):
            given = "omitted" if size is None else f"{size!r}"
            width, height = rule.default
            raise ApiError(
                400,
                f"size is {given}, and the default size {width}x{height} is outside this server's limits: "
                f"send a size; it must be {rule.allowed}",
                "size",
            )
        return rule.default
    match = re.fullmatch(rule.form, size)
    if match is None:
        raise ApiError(400, f"size={clip_repr(size)} is invalid: must be {rule.allowed}", "size")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class RequestBound:
    """A request field bounded by a server setting, declared once for the check (`check_bounds`) and for the schema
    (/openapi.json states `keyword: <the setting's value>` on the field)."""

    field: str
    keyword: Literal["maximum", "maxLength"]
    setting: str

    def limit(self, settings: ServerSettings) -> int:
        return getattr(settings, self.setting)


REQUEST_BOUNDS = (
    RequestBound("prompt", "maxLength", "max_prompt_chars"),
    RequestBound("negative_prompt", "maxLength", "max_prompt_chars"),
    RequestBound("n", "maximum", "max_n"),
    RequestBound("num_inference_steps", "maximum", "max_steps"),
)
"""Every bound of a request that comes from the server's settings (the size's are `SizeRule`'s)."""


def default_breaks_bound(bound: RequestBound, settings: ServerSettings, defaults: Defaults) -> bool:
    """Whether leaving `bound.field` out is a 400: its default (the variant's preset) is past the bound, so the
    schema lists the field as required."""
    default = getattr(defaults, bound.field, None)
    return isinstance(default, int) and bound.keyword == "maximum" and default > bound.limit(settings)


def check_bounds(request: ImageGenerationRequest, settings: ServerSettings, defaults: Defaults) -> None:
    """`REQUEST_BOUNDS` applied to `request` (a left-out field at its default): 400 naming the field, the value,
    the limit and the server option that sets it."""
    for bound in REQUEST_BOUNDS:
        value = getattr(request, bound.field)
        limit, option = bound.limit(settings), ServerSettings.flag(bound.setting)
        if value is None and default_breaks_bound(bound, settings, defaults):
            default = getattr(defaults, bound.field)
            message = (
                f"{bound.field} is omitted, and its default {default} (the served variant's preset) is past this "
                f"server's limit {limit} (server option {option}): send it, between 1 and {limit}"
            )
            raise ApiError(400, message, bound.field)
        if value is None:
            continue
        if bound.keyword == "maxLength" and len(value) > limit:
            message = f"{bound.field} is {len(value)} characters long; the limit is {limit} (server option {option})"
            raise ApiError(400, message, bound.field)
        if bound.keyword == "maximum" and value > limit:
            message = f"{bound.field}={value} is invalid: must be between 1 and {limit} (server option {option})"
            raise ApiError(400, message, bound.field)


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


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


_JSON_KINDS = {
    bool: ("a JSON boolean (true or false)", lambda v: isinstance(v, bool)),
    int: ("a JSON integer", _is_int),
    float: ("a JSON number", _is_number),
    str: ("a JSON string", lambda v: isinstance(v, str)),
}
_JSON_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object"}


def _unwrapped(kind: Any) -> Any:
    while get_origin(kind) is Annotated:
        kind = get_args(kind)[0]
    return kind


def _json_kind(key: str) -> tuple[str, Callable[[Any], bool]]:
    """What JSON value cache setting `key` takes in a request, in words, and its test (on `integral` values): its
    exact JSON type (a list is a JSON list, not the environment's comma-separated text), a choice as declared."""
    kind = _unwrapped(value_type(CacheConfig.model_fields[key]))
    if get_origin(kind) is Literal:
        choices = get_args(kind)
        return SETTINGS_BY_KEY[key].allowed, lambda v: any(type(v) is type(c) and v == c for c in choices)
    if get_origin(kind) is list:
        item_noun, item_fits = _JSON_KINDS[_unwrapped(get_args(kind)[0])]
        noun = "a JSON list of " + item_noun.removeprefix("a JSON ").removeprefix("an ") + "s"
        return noun, lambda v: isinstance(v, list) and all(item_fits(i) for i in v)
    return _JSON_KINDS[kind]


def _integral_json(value: Any) -> Any:
    """`value` with every number that equals an integer (4.0) as that integer, in lists too (`integral`)."""
    return [integral(item) for item in value] if isinstance(value, list) else integral(value)


def check_json_types(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`cache_dit_params` values must have their setting's JSON type (`"enable_cache": "yes"`,
    `"residual_diff_threshold": "0.2"` or `"scm_compute_bins": "8,3"` is a 400, not converted as an environment
    variable's text is); null and unknown keys are left to the engine's own checks. Returns the overrides with
    numbers that equal integers as integers (JSON Schema's "integer" admits `4.0`)."""
    checked = {}
    for key, value in overrides.items():
        if value is None or key not in CacheConfig.model_fields:
            checked[key] = value
            continue
        noun, fits = _json_kind(key)
        if not fits(value) and fits(_integral_json(value)):
            value = _integral_json(value)
        if not fits(value):
            got = _JSON_NAMES.get(type(value), type(value).__name__)
            kind = _unwrapped(value_type(CacheConfig.model_fields[key]))
            if get_origin(kind) is not Literal or type(value) not in {type(c) for c in get_args(kind)}:
                noun += f", got {'an' if got[0] in 'aeiou' else 'a'} {got}"  # the JSON type is wrong too
            raise ApiError(
                400,
                f"cache_dit_params: cache override key {key!r}={clip_repr(value)} is invalid: must be {noun}",
                "cache_dit_params",
            )
        checked[key] = value
    return checked


def effective_cache_config(overrides: Mapping[str, Any], base: CacheConfig, num_blocks: int | None) -> CacheConfig:
    """`base` with per-request `overrides`, validated exactly as the engine will (keys, values, block split) after
    `check_json_types`; a `ConfigError` becomes a 400 on `cache_dit_params`."""
    overrides = check_json_types(overrides)
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
    check_bounds(request, settings, defaults)
    width, height = parse_size(request.size, settings, defaults)
    steps = request.num_inference_steps if request.num_inference_steps is not None else defaults.num_inference_steps
    guidance = request.guidance_scale if request.guidance_scale is not None else defaults.guidance_scale
    overrides = check_json_types(request.cache_dit_params or {})
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
