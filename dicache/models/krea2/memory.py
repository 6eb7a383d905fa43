"""Krea-2's memory glue for `dicache.offload`: which components the pipeline has and when each runs, the bytes its
requests need, and how CFG runs under offload. The offload planner and streamers know blocks and bytes only; this
module knows Krea-2 (its text encoder's config, its VAE, its token layout) and hands them a `PipelineMemory`.

CFG batching: with layerwise offload the pipeline runs cond and uncond in one transformer call per step, so a streamed
block is copied once per step for both branches instead of once per branch (`cfg_batched=False` in a call still
separates them).
"""

from __future__ import annotations

from typing import Any

import torch

from dicache.blocks import stack_spec
from dicache.errors import ConfigError
from dicache.offload.estimate import (
    cache_bytes,
    dit_activation_bytes,
    stored_residuals_per_row,
    text_encoder_activation_bytes,
    vae_decode_bytes,
)
from dicache.offload.packing import module_bytes, packed_bytes
from dicache.offload.pipeline import (
    TRANSFORMER,
    PipelineMemory,
    PipelineOffload,
    PlannedRequest,
    active_cache_config,
    cache_always_run,
    compute_device,
    install_offload,
    quantize_block_by_block,
)
from dicache.offload.plan import MemoryNeeds
from dicache.offload.settings import OffloadLimits, OffloadSettings
from dicache.quantization import parse_quantization

PHASES = {
    "encode_prompt": ("text_encoder",),
    "text_conditioning": (TRANSFORMER,),
    "denoise": (TRANSFORMER,),
    "decode": ("vae",),
}
"""Pipeline methods wrapped for offload, and the components each one runs."""

DEFAULT_TEXT_TOKENS = 512
"""Text tokens per row planned for a pipeline without a text encoder (its callers pass embeddings)."""


def cfg_batched_under(settings: OffloadSettings) -> bool:
    """Whether CFG runs cond and uncond in one transformer call by default: with layerwise offload (one copy of each
    streamed block per step)."""
    return settings.dit_layerwise_offload


def pipeline_memory(pipe: Any) -> PipelineMemory:
    """The pipeline as the offload installer sees it: the transformer and its block stack, the text encoder's
    module and the VAE by role, and the phase methods (`PHASES`)."""
    text = pipe.text_encoder.text_encoder if pipe.text_encoder is not None else None
    return PipelineMemory(
        pipeline=pipe,
        transformer=pipe.transformer,
        stack=stack_spec(pipe.transformer),
        components={"text_encoder": text, "vae": pipe.vae},
        phases=PHASES,
        counted="denoise",
    )


def enable_offload(
    pipe: Any,
    settings: OffloadSettings,
    limits: OffloadLimits | None = None,
    device: torch.device | str | None = None,
    cache_config: Any = None,
    always_run: Any = None,
    reserve_bytes: int | None = None,
) -> PipelineOffload:
    """Measure, plan and install offload on a native Krea-2 pipeline (what `Krea2Pipeline.enable_offload` and
    `from_pretrained(..., dit_layerwise_offload=True)` call; quantize first: the plan reads the weights' bytes).

    limits: the largest request (default: the pipeline's default size, one image, CFG unless distilled). device:
    where to compute (default: CUDA if available). cache_config: the cache settings requests will use (default: the
    enabled cache's, else the environment's); its Fn/Bn blocks are kept resident first unless `always_run` lists
    the blocks every call runs. reserve_bytes: see `install_offload`. Raises `MemoryBudgetError` when nothing fits,
    `ConfigError` for bad values.
    """
    if getattr(pipe, "offload", None) is not None:
        pipe.offload.remove()
    limits = limits or OffloadLimits()
    device = compute_device(device)
    height = limits.max_height or pipe.default_size[0]
    width = limits.max_width or pipe.default_size[1]
    try:
        pipe.latent_grid(height, width)  # a clear error for sizes off the multiple
    except ValueError as exc:
        raise ConfigError(f"the largest request to plan for{limits.size_source}: {exc}") from None
    cfg = (not pipe.is_distilled) if limits.cfg is None else bool(limits.cfg)
    batched = cfg_batched_under(settings)
    config = cache_config if cache_config is not None else active_cache_config(pipe)
    memory = pipeline_memory(pipe)
    if always_run is None:
        always_run = cache_always_run(config, len(memory.stack.blocks))
    needs = memory_needs(pipe, height, width, limits.max_images, cfg, batched, config, limits.size_source)
    request = PlannedRequest(max_pixels=height * width, max_images=limits.max_images, cfg=cfg, cfg_batched=batched)
    return install_offload(memory, settings, needs, request, device, always_run, reserve_bytes)


def memory_needs(
    pipe: Any, height: int, width: int, images: int, cfg: bool, cfg_batched: bool, config: Any, size_source: str = ""
) -> MemoryNeeds:
    """What `pipe` needs on the device (reserve not included) for requests up to `height` x `width`, `images` per
    call, with or without CFG (batched into one call or not), under the cache settings `config`."""
    transformer = pipe.transformer
    blocks = stack_spec(transformer).blocks
    block_bytes = tuple(packed_bytes(block) for block in blocks)
    other = module_bytes(transformer) - sum(module_bytes(block) for block in blocks)
    element = torch.empty((), dtype=transformer.dtype).element_size()
    text = pipe.text_encoder
    text_tokens = text.max_sequence_length if text is not None else DEFAULT_TEXT_TOKENS
    multiple = pipe.size_multiple
    tokens = (height // multiple) * (width // multiple) + text_tokens
    branches = 2 if cfg else 1
    rows_per_call = images * (branches if cfg_batched else 1)
    hidden, intermediate = transformer.hidden_size, transformer.config["intermediate_size"]
    stored = stored_residuals_per_row(
        uses_diff=not config.decides_statically,
        taylorseer_order=config.taylorseer_order if config.enable_taylorseer else None,
    )
    needs = dict(
        block_bytes=block_bytes,
        other_dit_bytes=other,
        dit_activation_bytes=dit_activation_bytes(hidden, intermediate, rows_per_call, tokens, element),
        cache_bytes=cache_bytes(hidden, images * branches, tokens, element, stored, rows_per_call),
        shape=f"{width}x{height}, {rows_per_call} row(s) per transformer call{size_source}",
    )
    if text is not None:
        tc = text.text_config
        needs["text_encoder_bytes"] = module_bytes(text.text_encoder)
        needs["text_encoder_activation_bytes"] = text_encoder_activation_bytes(
            tc.num_hidden_layers,
            tc.hidden_size,
            tc.intermediate_size,
            images,
            text.prefix_len + text.max_sequence_length,
            len(text.select_layers),
            element,
        )
    if pipe.vae is not None:
        vc = pipe.vae.config
        factor = pipe.vae_scale_factor
        needs["vae_bytes"] = module_bytes(pipe.vae)
        needs["vae_activation_bytes"] = vae_decode_bytes(
            vc.z_dim, vc.base_dim, vc.dim_mult, height // factor, width // factor, images, element
        )
    return MemoryNeeds(**needs)


def quantize_through_device(pipe: Any, quantization: Any, device: torch.device | str | None = None) -> list[str]:
    """Quantize a transformer held in host memory block by block on `device` (`quantize_block_by_block`): FP8 is
    made on the GPU, where the bf16 transformer need not fit. Returns the quantized linears (as
    `Krea2Pipeline.quantize`)."""
    spec = parse_quantization(quantization) if isinstance(quantization, str) else quantization
    if spec is None:
        return []
    transformer = pipe.transformer
    done = quantize_block_by_block(transformer, stack_spec(transformer).blocks, spec, compute_device(device))
    transformer.quantization = spec
    return done
