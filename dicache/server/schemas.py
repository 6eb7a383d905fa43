"""Request and response bodies of the OpenAI-compatible endpoints (pydantic models; they also document the API).

Bounds that depend on the server's settings (`n`, `size`, steps, prompt length) are checked after parsing, by
`dicache.server.generation.resolve`, and stated in /openapi.json by `dicache.server.openapi`; the models here check
types and fixed ranges only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

SEED_MAX = 2**63 - 1

GUIDANCE_DOC = (
    "Classifier-free guidance scale in the standard convention: prediction = uncond + s * (cond - uncond). "
    "s = 1.0 means no CFG (one transformer pass per step, Turbo style); s > 1 runs CFG (Raw style: about 4.5); "
    "allowed: 1 <= s <= 100. "
    "Krea's reference form cond + g * (cond - uncond) has g = s - 1. Default: the served variant's preset."
)


def integral(value: Any) -> Any:
    """A JSON number without a fractional part (`4.0`) as the integer it is (JSON Schema's "integer" admits it, and
    /openapi.json says "integer"); anything else unchanged."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def only(*values: Any) -> Callable[[dict[str, Any]], None]:
    """`json_schema_extra` of an optional field that accepts only `values` (or null), whatever its type admits: the
    schema states what the validators let through."""

    def apply(schema: dict[str, Any]) -> None:
        schema.pop("type", None)
        schema["anyOf"] = [*({"const": value} for value in values), {"type": "null"}]

    return apply


OUTPUT_FORMATS = ("png", "jpeg", "webp")
IGNORED_FIELDS = ("quality", "style", "moderation", "complexity", "user", "safety_identifier")
"""OpenAI fields accepted and validated but without effect here (documented in the API description)."""


class ImageGenerationRequest(BaseModel):
    """`POST /v1/images/generations`: the OpenAI Images API's fields plus the diffusion and cache controls.

    Numbers and booleans are strict, as in OpenAI's API: `"n": true`, `"guidance_scale": "4.5"` or
    `"enable_cache": "yes"` are 400s, not silently converted (`"n": 2.0` is the JSON number 2, as JSON Schema has it).
    """

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = Field(None, description="The served model id (see GET /v1/models); optional.")
    prompt: StrictStr = Field(..., min_length=1, description="What to draw.")
    n: StrictInt = Field(1, ge=1, description="Number of images (bounded by the server's --max-n).")
    size: StrictStr | None = Field(
        None,
        description="'WIDTHxHEIGHT' in plain digits, each side a multiple of 16 within the server's limits, or 'auto' "
        "(the default size of the served model, when it is within them).",
    )
    response_format: Literal["b64_json"] | None = Field(
        None, description="Only 'b64_json' (base64 image in the response) is supported; this server hosts no URLs."
    )
    output_format: Literal["png", "jpeg", "webp"] | None = Field(
        None, description="Encoding of the returned images: png (default, lossless), jpeg or webp."
    )
    output_compression: StrictInt | None = Field(
        None,
        ge=0,
        le=100,
        description="jpeg / webp quality in percent (default 100); ignored for png, which is lossless.",
    )
    background: Literal["auto", "opaque"] | None = Field(
        None,
        description="'auto' or 'opaque' (the images are always opaque); 'transparent' is refused (no alpha channel).",
    )
    quality: Literal["low", "medium", "high", "xhigh", "max", "auto", "standard", "hd"] | None = Field(
        None, description="Accepted and ignored: quality is set by num_inference_steps and the cache settings."
    )
    style: Literal["vivid", "natural"] | None = Field(None, description="Accepted and ignored.")
    moderation: Literal["low", "auto"] | None = Field(
        None, description="Accepted and ignored: this server does no content moderation."
    )
    complexity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted and ignored.")
    user: StrictStr | None = Field(None, description="Accepted for OpenAI compatibility; ignored.")
    safety_identifier: StrictStr | None = Field(None, description="Accepted for OpenAI compatibility; ignored.")
    stream: StrictBool | None = Field(
        None, description="Only false: this server does not stream.", json_schema_extra=only(False)
    )
    partial_images: StrictInt | None = Field(
        None, description="Only 0 (no partial images): this server does not stream.", json_schema_extra=only(0)
    )
    frame_count: StrictInt | None = Field(
        None, description="GIF output only, which this server does not produce.", json_schema_extra=only()
    )
    frame_duration_ms: StrictInt | None = Field(
        None, description="GIF output only; not produced here.", json_schema_extra=only()
    )
    svg: dict[str, Any] | None = Field(
        None, description="SVG output only, which this server does not produce.", json_schema_extra=only()
    )
    negative_prompt: StrictStr | None = Field(None, description="What to steer away from (used when CFG is on).")
    num_inference_steps: StrictInt | None = Field(
        None, ge=1, description="Denoising steps; default: the variant's preset."
    )
    guidance_scale: float | None = Field(
        None, ge=1.0, le=100.0, allow_inf_nan=False, strict=True, description=GUIDANCE_DOC
    )
    seed: StrictInt | None = Field(
        None,
        ge=0,
        le=SEED_MAX,
        description="Random seed; the same seed and parameters give the same image. "
        "Default: a random seed, returned in the response.",
    )
    enable_cache: StrictBool | None = Field(
        None, description="Turn step caching on or off for this request; default: SGLANG_CACHE_DIT_ENABLED."
    )
    cache_dit_params: dict[str, Any] | None = Field(
        None,
        description="Per-request cache overrides keyed like cache-dit / SGLang (e.g. residual_diff_threshold, "
        "max_warmup_steps, scm_preset); values have their JSON types (no strings for numbers or booleans) and are "
        "validated exactly as the engine does. See `dicache config`. "
        "The top-level enable_cache, when given, wins over an enable_cache key here.",
    )

    @field_validator(
        "n",
        "output_compression",
        "partial_images",
        "frame_count",
        "frame_duration_ms",
        "num_inference_steps",
        "seed",
        mode="before",
    )
    @classmethod
    def _integral(cls, value: Any) -> Any:
        return integral(value)

    @field_validator("output_format", "background", "stream", mode="before")
    @classmethod
    def _explain_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI values this server cannot honour get a message saying why, not just the allowed list."""
        reason = _UNSUPPORTED.get((info.field_name, value if isinstance(value, str | bool) else None))
        if reason:
            raise ValueError(reason)
        return value

    @field_validator("partial_images")
    @classmethod
    def _no_partial_images(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("partial images need streaming, which this server does not do: send 0 or leave it out")
        return value

    @field_validator("frame_count", "frame_duration_ms", "svg")
    @classmethod
    def _only_for_other_formats(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            kind = "svg" if info.field_name == "svg" else "gif"
            raise ValueError(f"applies to output_format={kind!r}, which this server does not produce; leave it out")
        return value


_UNSUPPORTED = {
    ("output_format", "gif"): "this server produces still raster images: use png, jpeg or webp",
    ("output_format", "svg"): "this server produces raster images: use png, jpeg or webp",
    ("background", "transparent"): "the images have no alpha channel: use 'auto' or 'opaque'",
    ("stream", True): "this server does not stream: send false or leave it out",
}


class ImageObject(BaseModel):
    b64_json: str = Field(..., description="The image, base64-encoded in the response's output_format.")
    sha256: str = Field(
        ..., description="SHA-256 of the decoded float32 image array before 8-bit quantisation: a bitwise fingerprint."
    )


class Timings(BaseModel):
    queued_s: float = Field(..., description="Seconds waiting for a worker.")
    generate_s: float = Field(
        ...,
        description="Seconds from a worker taking the request to its answer: the model's phases, any wait for a phase "
        "busy with another request, and the image encoding.",
    )
    phases: dict[str, float] | None = Field(
        None,
        description="Seconds in each phase of the generation, its GPU work finished, waits for a busy phase "
        "excluded: encode (text encoder, starting noise), denoise, decode (VAE, pixels), image (image file, "
        "fingerprint, base64).",
    )


class GenerationInfo(BaseModel):
    """The parameters a request actually ran with (defaults filled in)."""

    model: str
    variant: str | None
    width: int
    height: int
    n: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    enable_cache: bool
    cache_overrides: dict[str, Any]


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageObject]
    output_format: Literal["png", "jpeg", "webp"] = "png"
    size: str = Field(..., description="'WIDTHxHEIGHT' of the images.")
    background: Literal["opaque"] = "opaque"
    cache_stats: dict[str, Any] | None = Field(
        None,
        description="This request's cache statistics (dicache.RequestStats.to_dict()): per CFG branch, the "
        "computed and cached steps, the residual diffs, and the compute fraction.",
    )
    generation: GenerationInfo
    timings: Timings


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dicache"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, so that the `openai` client raises with the message."""

    error: ErrorDetail


class HealthStatus(BaseModel):
    """`/health`: "ok" (200), or "draining" (503) once the server is shutting down."""

    status: Literal["ok", "draining"]


class ProbeResult(BaseModel):
    """`/health_generate`: the probe generation finished."""

    status: Literal["ok"]
    generate_s: float = Field(..., description="Seconds the probe generation took on its worker.")
