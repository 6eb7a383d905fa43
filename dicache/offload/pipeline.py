"""Offload for the native Krea-2 pipeline: measure, plan once under the budget, then place and stream.

`enable_pipeline_offload(pipe, settings, ...)` (what `Krea2Pipeline.enable_offload` and `from_pretrained(...,
dit_layerwise_offload=True, ...)` call) reads the loaded weights' bytes (after any quantization: quantize first),
estimates the working memory of the largest request it is told to serve, plans with `plan_memory` (an error before
the first request if nothing fits), then installs a `LayerwiseOffloader` for the transformer's blocks and/or a
`ComponentOffloader` for whole components. The pipeline's phases (`encode_prompt`, `text_conditioning`, `denoise`,
`decode`) are wrapped on the instance so each offloaded component is on the device only for its phase.

With layerwise offload, CFG runs batched (cond and uncond in one call per step): a streamed block is then copied
once per step for both branches instead of once per branch (`cfg_batched=False` in a call still separates them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import api
from .. import quantization as quant
from ..errors import ConfigError
from ..quantization import QuantizationSpec, parse_quantization, selected_linears
from ..settings.cache_config import CacheConfig
from .components import ComponentOffloader
from .estimate import (
    cache_bytes,
    dit_activation_bytes,
    stored_residuals_per_row,
    text_encoder_activation_bytes,
    vae_decode_bytes,
)
from .layerwise import LayerwiseOffloader, move_all_but
from .packing import module_bytes, packed_bytes
from .plan import BUDGET_FLAG, GiB, MemoryNeeds, MemoryPlan, OffloadSettings, plan_memory

PHASES = {
    "encode_prompt": ("text_encoder",),
    "text_conditioning": ("transformer",),
    "denoise": ("transformer",),
    "decode": ("vae",),
}
"""Pipeline methods wrapped for offload, and the components each one runs."""

DEFAULT_TEXT_TOKENS = 512


@dataclass
class RequestTransfer:
    """Host-to-device copies of one request's denoising with layerwise offload: `blocks` bytes streamed for the
    transformer's blocks and its transformer calls (`calls`: one `CallTransfer` each). Whole components brought in
    are counted by `ComponentOffloader.bytes_in`."""

    blocks: int = 0
    calls: list = field(default_factory=list)


@dataclass
class PipelineOffload:
    """What `enable_pipeline_offload` installed on a pipeline; `remove()` takes it off (weights stay where they are:
    resident parts on the device, offloaded ones in host memory).

    plan: the memory plan. max_pixels / max_images / cfg: the largest request planned for (`check_request` refuses
    bigger ones before they start). cfg_batched: how CFG runs by default with this offload.
    """

    plan: MemoryPlan
    settings: OffloadSettings
    device: torch.device
    max_pixels: int
    max_images: int
    cfg: bool
    cfg_batched: bool
    layerwise: LayerwiseOffloader | None = None
    components: ComponentOffloader | None = None
    last_request: RequestTransfer | None = None
    _undo: list = field(default_factory=list)

    def check_request(self, height: int, width: int, images: int, cfg: bool) -> None:
        """Refuse, before it starts, a request larger than the memory plan was made for."""
        if height * width > self.max_pixels or images > self.max_images or (cfg and not self.cfg):
            planned = (
                f"{self.max_pixels} pixels, {self.max_images} image(s) per call, CFG {'on' if self.cfg else 'off'}"
            )
            raise ValueError(
                f"this request ({width}x{height}, {images} image(s), CFG {'on' if cfg else 'off'}) is larger than the "
                f"memory plan's ({planned}); enable offload again with a larger max size / batch (and budget)"
            )

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def always_run_blocks(fn: int, bn: int, num_blocks: int, cached_step_blocks: Sequence[int] = ()) -> tuple[int, ...]:
    """The blocks every call runs under a cache with `fn` first and `bn` last always-computed blocks and the middle
    blocks a cached step still computes (`cached_step_blocks`), in stack order."""
    first, last = range(min(fn, num_blocks)), range(max(num_blocks - bn, fn), num_blocks)
    middle = sorted(b for b in set(cached_step_blocks) if fn <= b < num_blocks - bn)
    return tuple(first) + tuple(middle) + tuple(last)


def default_reserve_bytes(device: torch.device, budget_bytes: int | None) -> int:
    """Bytes a plan keeps free for allocator slack and library workspaces: on CUDA the larger of 0.5 GiB and 2 % of
    the budget, elsewhere (or without a budget) none."""
    return max(GiB // 2, int(0.02 * budget_bytes)) if (device.type == "cuda" and budget_bytes) else 0


def enable_pipeline_offload(
    pipe: Any,
    settings: OffloadSettings,
    device: torch.device | str | None = None,
    max_height: int | None = None,
    max_width: int | None = None,
    max_images: int = 1,
    cfg: bool | None = None,
    always_run: Sequence[int] | None = None,
    reserve_bytes: int | None = None,
    size_source: str = "",
    cache_config: Any = None,
) -> PipelineOffload:
    """Plan and install offload on a native Krea-2 pipeline (see the module docstring).

    device: where to compute (default: CUDA if available). max_height / max_width (default: the pipeline's default
    size), max_images (images per call) and cfg (default: unless the checkpoint is distilled) bound the requests the
    plan must hold. always_run: blocks every call runs (default: the cache settings' Fn/Bn blocks, from the enabled
    cache or the environment). reserve_bytes: kept free for allocator slack and workspaces (default: on CUDA
    max(0.5 GiB, 2 % of the budget), else 0). size_source: where the size bounds came from, for messages.
    cache_config: the cache settings requests will use (default: the enabled cache's, else the environment's).
    Raises `MemoryBudgetError` when nothing fits, `ConfigError` for bad values.
    """
    if getattr(pipe, "offload", None) is not None:
        pipe.offload.remove()
    if not isinstance(max_images, int) or isinstance(max_images, bool) or max_images < 1:
        raise ConfigError(f"max_images={max_images!r} is invalid: must be an integer >= 1")
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={str(device)!r} is invalid: CUDA is not available on this machine")
    transformer = pipe.transformer
    height, width = max_height or pipe.default_size[0], max_width or pipe.default_size[1]
    pipe.latent_grid(height, width)  # a clear error for sizes off the multiple
    cfg = (not pipe.is_distilled) if cfg is None else bool(cfg)
    cfg_batched = settings.dit_layerwise_offload
    config = cache_config if cache_config is not None else _cache_config(pipe)
    blocks = transformer.transformer_blocks
    if always_run is None:
        always_run = always_run_blocks(
            config.Fn_compute_blocks, config.Bn_compute_blocks, len(blocks), config.cached_step_blocks or ()
        )

    needs = memory_needs(pipe, height, width, max_images, cfg, cfg_batched, config, size_source)
    budget, source = _budget(settings, device)
    if reserve_bytes is None:
        reserve_bytes = default_reserve_bytes(device, budget)
    needs = MemoryNeeds(**{**needs.__dict__, "reserve_bytes": int(reserve_bytes)})
    plan = plan_memory(needs, settings, budget, always_run, source)

    handle = PipelineOffload(
        plan=plan,
        settings=settings,
        device=device,
        max_pixels=height * width,
        max_images=max_images,
        cfg=cfg,
        cfg_batched=cfg_batched,
    )
    components = ComponentOffloader(device, settings.pin_cpu_memory)
    text_encoder = getattr(pipe.text_encoder, "text_encoder", None) if pipe.text_encoder is not None else None
    for name, module, offloaded in (
        ("text_encoder", text_encoder, settings.text_encoder_cpu_offload),
        ("vae", pipe.vae, settings.vae_cpu_offload),
    ):
        if module is None:
            continue
        if offloaded:
            module.to("cpu")
            components.add(name, module)
        else:
            module.to(device)
    if plan.dit_mode == "layerwise":
        handle.layerwise = LayerwiseOffloader(
            transformer, plan.resident, plan.num_slots, device, pin_memory=settings.pin_cpu_memory
        )
    elif plan.dit_mode == "cpu":
        transformer.to("cpu")
        components.add("transformer", transformer)
    else:
        transformer.to(device)
    handle.components = components if components.components else None
    _wrap_phases(pipe, handle)
    pipe.offload = handle

    def take_off() -> None:
        if handle.layerwise is not None:
            handle.layerwise.close()
        if handle.components is not None:
            handle.components.close()
        if getattr(pipe, "offload", None) is handle:
            pipe.offload = None

    handle._undo.insert(0, take_off)
    return handle


def quantize_through_device(pipe: Any, quantization: Any, device: torch.device | str | None = None) -> list[str]:
    """Quantize a transformer held in host memory one block at a time on `device` (FP8 is made on the GPU, and the
    bf16 transformer need not fit there whole): the parts outside the blocks go to `device`, then each block goes
    there, is quantized, and returns to the host. Returns the quantized linears (as `Krea2Pipeline.quantize`)."""
    spec = parse_quantization(quantization) if isinstance(quantization, str) else quantization
    if spec is None:
        return []
    device = torch.device(device) if device is not None else _default_device()
    transformer = pipe.transformer
    blocks = transformer.transformer_blocks
    names = selected_linears(transformer, spec)
    move_all_but(transformer, blocks, set(range(len(blocks))), device)
    done: list[str] = []
    groups = [[n for n in names if n.startswith(f"transformer_blocks.{i}.")] for i in range(len(blocks))]
    for block, group in zip(blocks, groups):
        if group:
            block.to(device)
            done += quant.quantize_transformer(
                transformer, QuantizationSpec(spec.method, include=tuple(group), exclude=())
            )
            block.to("cpu")
    outside = [n for n in names if not n.startswith("transformer_blocks.")]
    if outside:
        done += quant.quantize_transformer(
            transformer, QuantizationSpec(spec.method, include=tuple(outside), exclude=())
        )
    transformer.quantization = spec
    return sorted(done)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cache_config(pipe: Any):
    """The cache settings the pipeline runs with: its enabled session's, else the environment's."""
    if api.is_enabled(pipe):
        return api.session_of(pipe).config
    return CacheConfig.from_env()


def _budget(settings: OffloadSettings, device: torch.device) -> tuple[int | None, str]:
    if settings.gpu_memory_budget is not None:
        return int(settings.gpu_memory_budget * GiB), f"{BUDGET_FLAG} {settings.gpu_memory_budget:g}"
    if device.type != "cuda":
        return None, ""
    free, _ = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)  # ours already: the pipeline's weights count against the budget
    return free + held, f"free memory on {device} at load time"


def memory_needs(
    pipe: Any, height: int, width: int, images: int, cfg: bool, cfg_batched: bool, config: Any, size_source: str = ""
) -> MemoryNeeds:
    """What `pipe` needs on the device (reserve not included) for requests up to `height` x `width`, `images` per
    call, with or without CFG (batched into one call or not), under the cache settings `config`."""
    transformer = pipe.transformer
    blocks = transformer.transformer_blocks
    block_bytes = tuple(packed_bytes(block) for block in blocks)
    other = module_bytes(transformer) - sum(module_bytes(block) for block in blocks)
    element = torch.empty((), dtype=transformer.dtype).element_size()
    text_tokens = DEFAULT_TEXT_TOKENS
    text = pipe.text_encoder
    if text is not None:
        text_tokens = text.max_sequence_length
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


def _wrap_phases(pipe: Any, handle: PipelineOffload) -> None:
    """Wrap the pipeline's phase methods on the instance: enter the phase's components, and count the bytes each
    denoising moved."""
    for name, needed in PHASES.items():
        original = getattr(pipe, name)
        had_own = name in pipe.__dict__

        @functools.wraps(original)
        def wrapper(*args, _original=original, _needed=needed, _name=name, **kwargs):
            if handle.components is not None:
                handle.components.enter(_needed)
            if _name != "denoise":
                return _original(*args, **kwargs)
            return _counted(handle, _original, args, kwargs)

        pipe.__dict__[name] = wrapper

        def restore(name=name, original=original, had_own=had_own) -> None:
            if had_own:
                pipe.__dict__[name] = original
            else:
                pipe.__dict__.pop(name, None)

        handle._undo.append(restore)


def _counted(handle: PipelineOffload, denoise, args, kwargs):
    layerwise = handle.layerwise
    if layerwise is None:
        return denoise(*args, **kwargs)
    before = layerwise.totals()
    try:
        return denoise(*args, **kwargs)
    finally:
        after = layerwise.totals()
        count = after.calls - before.calls
        calls = list(layerwise.calls)[-count:] if count else []
        handle.last_request = RequestTransfer(blocks=after.bytes - before.bytes, calls=calls)
