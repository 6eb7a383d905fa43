"""Speed and memory set-up of a loaded Krea-2 pipeline: FP8 quantisation, `torch.compile`, offloading.

`PipelineOptimizations` is mixed into `Krea2Pipeline`; it needs the pipeline's `transformer` and `offload` attributes
and delegates to `dicache.quantization` and, for memory, to Krea-2's memory glue (`memory`, over `dicache.offload`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from dicache.models.compile_artifact import ArtifactKey, config_digest, dicache_version, runtime_fields
from dicache.models.krea2 import memory
from dicache.offload.plan import MemoryPlan
from dicache.offload.settings import OffloadLimits, OffloadSettings
from dicache.quantization import (
    QuantizationError,
    QuantizationSpec,
    parse_quantization,
    quantize_text_encoder,
    quantize_transformer,
)

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

    def quantize_text_encoder(self, method: str = "fp8") -> list[str]:
        """FP8 for the text encoder's decoder-layer linears in place (`dicache.quantization.quantize_text_encoder`);
        returns their names. Raises `QuantizationError` where FP8 cannot run, or without a text encoder."""
        encoder = getattr(self, "text_encoder", None)
        if encoder is None:
            raise QuantizationError("text encoder quantization: this pipeline has no text encoder")
        names = quantize_text_encoder(getattr(encoder, "text_encoder", encoder), method)
        self.text_encoder_quantization = method
        return names

    def compile(
        self: _Pipe,
        *,
        dynamic: bool | None = None,
        backend: str = "inductor",
        vae: bool | None = None,
        text_encoder: bool | None = None,
    ) -> _Pipe:
        """`torch.compile` the transformer blocks (see `Krea2Transformer.compile_blocks`) and the VAE decoder, and
        replay the text encoder from CUDA graphs; the first call at a new shape compiles (tens of seconds at full
        size) or captures, later calls reuse the graphs. Returns self.

        vae: compile the VAE decoder too (None: unless the pipeline is offloaded, whose VAE moves between devices).
        Its work is mostly memory-bound elementwise passes (channel RMSNorm in float32, SiLU, residual adds over
        full-resolution activations) that compiling fuses.
        text_encoder: CUDA graphs of the text encoder's forward, its FP8-stored linears compiled
        (`Krea2TextEncoder.compile`; None: when it is on a CUDA device and the pipeline is not offloaded). It runs
        once per prompt at one padded shape, so its eager time is the CPU launching a few hundred kernels; replayed,
        only the GPU's. Same values as eager.
        Call after any quantisation."""
        offloaded = getattr(self, "offload", None) is not None
        self.transformer.compile_blocks(dynamic=dynamic, backend=backend)
        decoder = getattr(getattr(self, "vae", None), "decoder", None)
        if vae is None:
            vae = decoder is not None and not offloaded
        if vae:
            if decoder is None:
                raise ValueError("compile(vae=True): this pipeline has no VAE decoder")
            decoder.compile(dynamic=dynamic, backend=backend)
        encoder = getattr(self, "text_encoder", None)
        if text_encoder is None:
            text_encoder = encoder is not None and encoder.device.type == "cuda" and not offloaded
        if text_encoder:
            if encoder is None:
                raise ValueError("compile(text_encoder=True): this pipeline has no text encoder")
            if encoder.device.type != "cuda" or offloaded:
                where = "offloaded" if offloaded else f"on {encoder.device}"
                raise ValueError(
                    f"compile(text_encoder=True): the text encoder's CUDA graphs need it resident on a CUDA device; "
                    f"it is {where}"
                )
            encoder.compile(backend)
        self.compile_options = {"dynamic": dynamic, "backend": str(backend), "vae": vae, "text_encoder": text_encoder}
        return self

    def compile_key(self, shapes: Mapping[str, Any]) -> ArtifactKey:
        """The key of this pipeline's compile artifact (`dicache.models.compile_artifact`): this process's software
        and GPU, the components' configurations and dtype, the quantisation of the transformer and the text encoder,
        the compile options (`compile`'s arguments) and `shapes`, what the caller warms up (JSON)."""
        transformer = self.transformer
        encoder = getattr(self, "text_encoder", None)
        model = getattr(encoder, "text_encoder", None)
        vae = getattr(self, "vae", None)
        fields = {
            **runtime_fields(self.device),
            "dicache": dicache_version(),
            "dtype": str(transformer.dtype),
            "transformer": config_digest(dict(transformer.config)),
            "text_encoder": config_digest(_public(model.config.to_dict())) if model is not None else "none",
            "vae": config_digest(vae.config) if vae is not None else "none",
            "quantization": repr(getattr(transformer, "quantization", None)),
            "text_encoder_quantization": str(getattr(self, "text_encoder_quantization", None)),
            "compile": json.dumps(getattr(self, "compile_options", None), sort_keys=True),
            "shapes": json.dumps(shapes, sort_keys=True, default=str),
        }
        return ArtifactKey(fields)

    # ------------------------------------------------------------------ memory
    def enable_offload(
        self,
        settings: OffloadSettings | None = None,
        *,
        device: str | torch.device | None = None,
        max_height: int | None = None,
        max_width: int | None = None,
        max_images: int = 1,
        cfg: bool | None = None,
        size_source: str = "",
        cache_config: Any = None,
        **options: Any,
    ) -> MemoryPlan:
        """Fit the pipeline in a GPU memory budget, with SGLang's option names and meanings: `settings`, or the
        same options by name (`dit_layerwise_offload=True, gpu_memory_budget=23.5, ...`: the fields of
        `dicache.offload.settings.OffloadSettings`, which say what each does).

        With `dit_layerwise_offload` the blocks that do not fit stream, copying only the blocks each call runs (a
        cached step's skipped blocks are never copied), and CFG runs batched (one transformer call per step for
        cond and uncond). device: where to compute (default CUDA if available). max_height, max_width, max_images
        (images per call), cfg: the largest request to plan for (defaults: the default size, 1 image, CFG unless
        distilled); larger requests are refused before they start. cache_config: the cache settings requests will
        use (its Fn/Bn blocks are kept resident first; default: the enabled cache's, else the environment's).

        Call it after any quantization. Returns the memory plan; raises `MemoryBudgetError` (naming what was
        needed and what was available) when nothing fits. Output images stay bitwise equal to the resident run
        with the same CFG batching.
        """
        settings = OffloadSettings.given(settings, options)
        limits = OffloadLimits(max_height, max_width, max_images, cfg, size_source)
        encoder = getattr(self, "text_encoder", None)
        if getattr(encoder, "cuda_graphs", False):  # its graphs read the weights where they were captured
            encoder.use_cuda_graphs(False)
        return memory.enable_offload(self, settings, limits, device, cache_config).plan

    def disable_offload(self) -> None:
        """Stop offloading: streamed / offloaded weights stay in host memory, the rest on the device."""
        if self.offload is not None:
            self.offload.remove()


def _public(config: dict) -> dict:
    """A transformers configuration without its private entries (`_name_or_path`: where it was read from)."""
    return {key: value for key, value in config.items() if not key.startswith("_")}
