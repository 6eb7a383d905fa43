"""Speed and memory set-up of a loaded Krea-2 pipeline: FP8 quantisation, `torch.compile`, offloading.

`PipelineOptimizations` is mixed into `Krea2Pipeline`; it needs the pipeline's `transformer` and `offload` attributes
and delegates to `dicache.quantization` and `dicache.offload`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from dicache.offload.pipeline import enable_pipeline_offload
from dicache.offload.plan import OffloadSettings
from dicache.quantization import QuantizationSpec, parse_quantization, quantize_transformer


def offload_settings(*options: Any) -> Any:
    """`dicache.offload.plan.OffloadSettings` from the offload options in their declared order (dit_layerwise_offload,
    dit_offload_prefetch_size, dit_cpu_offload, text_encoder_cpu_offload, vae_cpu_offload, pin_cpu_memory,
    gpu_memory_budget), validated; what `from_pretrained` and `enable_offload` both take."""
    return OffloadSettings(*options)


_Pipe = TypeVar("_Pipe", bound="PipelineOptimizations")


class PipelineOptimizations:
    """Quantise, compile and offload the pipeline in place."""

    transformer: Any
    offload: Any

    def quantize(self, quantization: str | QuantizationSpec) -> list[str]:
        """Quantise the transformer in place (`"fp8"` or a `QuantizationSpec`); returns the quantised linears.

        Raises `QuantizationError` where FP8 cannot run (CPU, GPU below compute capability 8.9, no torchao).
        """
        spec = parse_quantization(quantization) if isinstance(quantization, str) else quantization
        if spec is None:
            return []
        return quantize_transformer(self.transformer, spec)

    def compile(self: _Pipe, *, dynamic: bool | None = None, backend: str = "inductor") -> _Pipe:
        """`torch.compile` the transformer blocks (see `Krea2Transformer.compile_blocks`); the first call at a new
        shape compiles (tens of seconds at full size), later calls reuse the graphs. Returns self."""
        self.transformer.compile_blocks(dynamic=dynamic, backend=backend)
        return self

    # ------------------------------------------------------------------ memory
    def enable_offload(
        self,
        dit_layerwise_offload: bool = False,
        dit_offload_prefetch_size: float = 0.0,
        dit_cpu_offload: bool = False,
        text_encoder_cpu_offload: bool = False,
        vae_cpu_offload: bool = False,
        pin_cpu_memory: bool = True,
        gpu_memory_budget: float | None = None,
        *,
        device: str | torch.device | None = None,
        max_height: int | None = None,
        max_width: int | None = None,
        max_images: int = 1,
        cfg: bool | None = None,
        size_source: str = "",
        cache_config: Any = None,
    ):
        """Fit the pipeline in a GPU memory budget, with SGLang's option names and meanings.

        dit_layerwise_offload: keep as many transformer blocks resident as the budget allows and stream the rest,
            copying only the blocks each call runs (a cached step's skipped blocks are never copied); CFG then runs
            batched (one transformer call per step for cond and uncond).
        dit_offload_prefetch_size: blocks copied ahead of the running one (< 1: fraction of the layers, >= 1: count).
        dit_cpu_offload: keep the whole transformer on the host, brought in for each denoising.
        text_encoder_cpu_offload / vae_cpu_offload: same for the text encoder / the VAE, around their use.
        pin_cpu_memory: page-lock host copies (fast asynchronous copies).
        gpu_memory_budget: GiB the pipeline may use (default: free device memory at this point).
        device: where to compute (default CUDA if available). max_height, max_width, max_images (images per call),
            cfg: the largest request to plan for (defaults: the default size, 1 image, CFG unless distilled); larger
            requests are refused before they start.
        cache_config: the cache settings requests will use (its Fn/Bn blocks are kept resident first; default: the
            enabled cache's, else the environment's).

        Call it after any quantization. Returns the memory plan; raises `MemoryBudgetError` (naming what was
        needed and what was available) when nothing fits. Output images stay bitwise equal to the resident run
        with the same CFG batching.
        """
        settings = offload_settings(
            dit_layerwise_offload, dit_offload_prefetch_size, dit_cpu_offload, text_encoder_cpu_offload,
            vae_cpu_offload, pin_cpu_memory, gpu_memory_budget,
        )  # fmt: skip
        limits = dict(max_height=max_height, max_width=max_width, max_images=max_images, cfg=cfg)
        return enable_pipeline_offload(
            self, settings, device, **limits, size_source=size_source, cache_config=cache_config
        ).plan

    def disable_offload(self) -> None:
        """Stop offloading: streamed / offloaded weights stay in host memory, the rest on the device."""
        if self.offload is not None:
            self.offload.remove()
