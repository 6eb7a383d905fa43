"""Request and response bodies of the OpenAI-compatible endpoints (pydantic models; they also document the API).

Bounds that depend on the server's settings (`n`, `size`, steps, prompt length) are checked after parsing, by
`dicache.server.requests.resolve`; the models here check types and fixed ranges only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_MAX = 2**63 - 1

GUIDANCE_DOC = (
    "Classifier-free guidance scale in the standard convention: prediction = uncond + s * (cond - uncond). "
    "s = 1.0 means no CFG (one transformer pass per step, Turbo style); s > 1 runs CFG (Raw style: about 4.5); "
    "allowed: 1 <= s <= 100. "
    "Krea's reference form cond + g * (cond - uncond) has g = s - 1. Default: the served variant's preset."
)


class ImageGenerationRequest(BaseModel):
    """`POST /v1/images/generations`: OpenAI's fields plus the diffusion and cache controls."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="The served model id (see GET /v1/models); optional.")
    prompt: str = Field(..., min_length=1, description="What to draw.")
    n: int = Field(1, ge=1, description="Number of images (bounded by the server's --max-n).")
    size: str | None = Field(
        None,
        description="'WIDTHxHEIGHT', each side a multiple of 16 within the server's limits, or 'auto' (the default "
        "size of the served model).",
        examples=["1024x1024"],
    )
    response_format: Literal["b64_json"] = Field(
        "b64_json", description="Only 'b64_json' (base64 PNG in the response) is supported; this server hosts no URLs."
    )
    user: str | None = Field(None, description="Accepted for OpenAI compatibility; ignored.")
    negative_prompt: str | None = Field(None, description="What to steer away from (used when CFG is on).")
    num_inference_steps: int | None = Field(None, ge=1, description="Denoising steps; default: the variant's preset.")
    guidance_scale: float | None = Field(None, ge=1.0, le=100.0, allow_inf_nan=False, description=GUIDANCE_DOC)
    seed: int | None = Field(
        None,
        ge=0,
        le=SEED_MAX,
        description="Random seed; the same seed and parameters give the same image. "
        "Default: a random seed, returned in the response.",
    )
    enable_cache: bool | None = Field(
        None, description="Turn step caching on or off for this request; default: SGLANG_CACHE_DIT_ENABLED."
    )
    cache_dit_params: dict[str, Any] | None = Field(
        None,
        description="Per-request cache overrides keyed like cache-dit / SGLang (e.g. residual_diff_threshold, "
        "max_warmup_steps, scm_preset); validated exactly as the engine does. See `dicache config`. "
        "The top-level enable_cache, when given, wins over an enable_cache key here.",
    )


class ImageObject(BaseModel):
    b64_json: str = Field(..., description="The image as a base64-encoded PNG.")
    sha256: str = Field(
        ..., description="SHA-256 of the decoded float32 image array before 8-bit quantisation: a bitwise fingerprint."
    )


class Timings(BaseModel):
    queued_s: float = Field(..., description="Seconds waiting for a worker.")
    generate_s: float = Field(..., description="Seconds generating (pipeline call and PNG encoding).")


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
