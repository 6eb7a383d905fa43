"""Offload installed on a pipeline from what its model says about it: plan once under the budget, then place and
stream. Model-agnostic: the model's memory glue (e.g. `dicache.models.krea2.memory`) describes the pipeline as a
`PipelineMemory` (its denoiser's block stack, its other components by role, which method runs which of them) and
measures its `MemoryNeeds`; this module knows blocks, bytes and the block plan, never a model's attributes.

`install_offload(memory, settings, needs, request, device, always_run)` plans with `plan_memory` (an error before
the first request if nothing fits), then installs a `LayerwiseOffloader` for the stack's blocks and/or a
`ComponentOffloader` for whole components, and wraps the pipeline's phase methods on the instance so that each
offloaded component is on the device only for its phase.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import api
from .. import quantization as quant
from ..quantization import QuantizationSpec
from ..settings.cache_config import CacheConfig
from ..settings.devices import resolve_device
from .components import ComponentOffloader
from .layerwise import LayerwiseOffloader, move_all_but
from .plan import BUDGET_FLAG, GiB, MemoryNeeds, MemoryPlan, plan_memory
from .settings import OffloadSettings

TRANSFORMER = "transformer"
"""The role of the denoiser among a pipeline's components (`PipelineMemory.phases`)."""


@dataclass(frozen=True)
class PipelineMemory:
    """What a model hands the offload installer about one loaded pipeline.

    pipeline: the object whose phase methods are wrapped (on the instance) and whose `offload` attribute holds the
        installed `PipelineOffload`.
    transformer: the denoiser; everything in it outside `stack.blocks` stays on the device (or moves whole with
        `dit_cpu_offload`).
    stack: the denoiser's block stack as the engine describes it (`blocks` in stack order, possibly from several
        block lists, and the seam the layerwise offloader observes through `observe_blocks`).
    components: the other whole components by role ("text_encoder", "vae"; None: the pipeline has none), offloaded
        as `OffloadSettings.offloads(role)` says.
    phases: pipeline method -> the roles it runs (`TRANSFORMER` for the denoiser).
    counted: the method whose streamed bytes are counted per request (`PipelineOffload.last_request`).
    """

    pipeline: Any
    transformer: nn.Module
    stack: Any
    components: Mapping[str, nn.Module | None]
    phases: Mapping[str, tuple[str, ...]]
    counted: str


@dataclass(frozen=True)
class PlannedRequest:
    """The largest request a plan holds: pixels per image, images per call, whether CFG runs, and whether its
    branches run batched in one denoiser call (the model's choice under these settings)."""

    max_pixels: int
    max_images: int
    cfg: bool
    cfg_batched: bool


@dataclass
class RequestTransfer:
    """Host-to-device copies of one request's denoising with layerwise offload: `blocks` bytes streamed for the
    transformer's blocks and its transformer calls (`calls`: one `CallTransfer` each). Whole components brought in
    are counted by `ComponentOffloader.bytes_in`."""

    blocks: int = 0
    calls: list = field(default_factory=list)


@dataclass
class PipelineOffload:
    """What `install_offload` installed on a pipeline; `remove()` takes it off (weights stay where they are:
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


def cache_always_run(config: CacheConfig, num_blocks: int) -> tuple[int, ...]:
    """`always_run_blocks` of a cache config: its Fn / Bn blocks and `cached_step_blocks`."""
    return always_run_blocks(
        config.Fn_compute_blocks, config.Bn_compute_blocks, num_blocks, config.cached_step_blocks or ()
    )


def default_reserve_bytes(device: torch.device, budget_bytes: int | None) -> int:
    """Bytes a plan keeps free for allocator slack and library workspaces: on CUDA the larger of 0.5 GiB and 2 % of
    the budget, elsewhere (or without a budget) none."""
    return max(GiB // 2, int(0.02 * budget_bytes)) if (device.type == "cuda" and budget_bytes) else 0


def compute_device(device: torch.device | str | None) -> torch.device:
    """Where offloaded parts run: `device`, else CUDA if available; a CUDA device without CUDA is a ConfigError."""
    return resolve_device(device, "device")


def active_cache_config(pipe: Any) -> CacheConfig:
    """The cache settings a pipeline runs with: its enabled session's, else the environment's."""
    if api.is_enabled(pipe):
        return api.session_of(pipe).config
    return CacheConfig.from_env()


def install_offload(
    memory: PipelineMemory,
    settings: OffloadSettings,
    needs: MemoryNeeds,
    request: PlannedRequest,
    device: torch.device,
    always_run: Sequence[int],
    reserve_bytes: int | None = None,
) -> PipelineOffload:
    """Plan and install offload (see the module docstring); replaces an offload already installed.

    needs: the pipeline's bytes at `request` (reserve not included). always_run: the stack blocks every call runs
    (kept resident first). reserve_bytes: kept free for allocator slack and workspaces (default:
    `default_reserve_bytes`). Raises `MemoryBudgetError` when nothing fits, before anything moves.
    """
    pipe = memory.pipeline
    if getattr(pipe, "offload", None) is not None:
        pipe.offload.remove()
    budget, source = _budget(settings, device)
    if reserve_bytes is None:
        reserve_bytes = default_reserve_bytes(device, budget)
    plan = plan_memory(
        dataclasses.replace(needs, reserve_bytes=int(reserve_bytes)), settings, budget, always_run, source
    )

    handle = PipelineOffload(
        plan=plan,
        settings=settings,
        device=device,
        max_pixels=request.max_pixels,
        max_images=request.max_images,
        cfg=request.cfg,
        cfg_batched=request.cfg_batched,
    )
    components = ComponentOffloader(device, settings.pin_cpu_memory)
    for role, module in memory.components.items():
        if module is None:
            continue
        if settings.offloads(role):
            module.to("cpu")
            components.add(role, module)
        else:
            module.to(device)
    transformer = memory.transformer
    if plan.dit_mode == "layerwise":
        handle.layerwise = LayerwiseOffloader(
            transformer, plan.resident, plan.num_slots, device, pin_memory=settings.pin_cpu_memory, spec=memory.stack
        )
    elif plan.dit_mode == "cpu":
        transformer.to("cpu")
        components.add(TRANSFORMER, transformer)
    else:
        transformer.to(device)
    handle.components = components if components.components else None
    _wrap_phases(memory, handle)
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


def quantize_block_by_block(
    transformer: nn.Module, blocks: Sequence[nn.Module], spec: QuantizationSpec, device: torch.device
) -> list[str]:
    """Quantize a transformer held in host memory one block at a time on `device` (FP8 is made on the GPU, and the
    bf16 transformer need not fit there whole): the parts outside `blocks` go to `device`, then each block goes
    there, is quantized, and returns to the host. Returns the quantized linears (qualified names, sorted)."""
    names = quant.selected_linears(transformer, spec)
    move_all_but(transformer, blocks, set(range(len(blocks))), device)
    where = {id(module): name for name, module in transformer.named_modules()}
    prefixes = [where[id(block)] + "." for block in blocks]
    done: list[str] = []
    for block, prefix in zip(blocks, prefixes):
        group = [n for n in names if n.startswith(prefix)]
        if group:
            block.to(device)
            done += quant.quantize_transformer(
                transformer, QuantizationSpec(spec.method, include=tuple(group), exclude=())
            )
            block.to("cpu")
    outside = [n for n in names if not n.startswith(tuple(prefixes))]
    if outside:
        done += quant.quantize_transformer(
            transformer, QuantizationSpec(spec.method, include=tuple(outside), exclude=())
        )
    return sorted(done)


def _budget(settings: OffloadSettings, device: torch.device) -> tuple[int | None, str]:
    if settings.gpu_memory_budget is not None:
        return int(settings.gpu_memory_budget * GiB), f"{BUDGET_FLAG} {settings.gpu_memory_budget:g}"
    if device.type != "cuda":
        return None, ""
    free, _ = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)  # ours already: the pipeline's weights count against the budget
    return free + held, f"free memory on {device} at load time"


def _wrap_phases(memory: PipelineMemory, handle: PipelineOffload) -> None:
    """Wrap the pipeline's phase methods on the instance: enter the phase's components, and count the bytes each
    counted phase moved."""
    pipe = memory.pipeline
    for name, needed in memory.phases.items():
        original = getattr(pipe, name)
        had_own = name in pipe.__dict__
        counted = name == memory.counted

        @functools.wraps(original)
        def wrapper(*args, _original=original, _needed=needed, _counted=counted, **kwargs):
            if handle.components is not None:
                handle.components.enter(_needed)
            if not _counted:
                return _original(*args, **kwargs)
            return _count(handle, _original, args, kwargs)

        pipe.__dict__[name] = wrapper

        def restore(name=name, original=original, had_own=had_own) -> None:
            if had_own:
                pipe.__dict__[name] = original
            else:
                pipe.__dict__.pop(name, None)

        handle._undo.append(restore)


def _count(handle: PipelineOffload, run: Callable, args: tuple, kwargs: dict) -> Any:
    layerwise = handle.layerwise
    if layerwise is None:
        return run(*args, **kwargs)
    before = layerwise.totals()
    try:
        return run(*args, **kwargs)
    finally:
        after = layerwise.totals()
        count = after.calls - before.calls
        calls = list(layerwise.calls)[-count:] if count else []
        handle.last_request = RequestTransfer(blocks=after.bytes - before.bytes, calls=calls)
