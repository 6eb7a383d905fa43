"""Krea-2 text-to-image: prompts -> text conditioning -> flow-match Euler denoising -> VAE decode.

Guidance follows the standard convention used by the serving docs: `v = uncond + s·(cond − uncond)`, `s = 1` means
no CFG (no uncond pass). Krea's reference form (and diffusers' `Krea2Pipeline`) writes `cond + g·(cond − uncond)`;
the two are the same with `g = s − 1` (Raw's s = 4.5 is g = 3.5), and this pipeline computes the reference form so
its numbers match diffusers'. Presets: `turbo` = 8 steps, no CFG, shift pinned at mu = 1.15; `raw` = 50 steps, s = 4.5.

Model code has no cache logic. Two neutral seams let a cache engine observe the loop: `request_scope(num_steps,
sigmas)` around one generation, `call_scope(step, branch, sigma)` around each transformer call, where `branch` is
"cond", "uncond" or "batched" (cond and uncond in one batch).

Memory (small GPUs): `enable_offload(...)` (or the same options on `from_pretrained`) installs `dicache.offload`'s
planner and offloaders. A call runs its phases in order (encode every prompt, text conditioning, denoise, decode) so
an offloaded component is brought in once per call.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from dicache.models.krea2.scheduler import TURBO_MU, FlowMatchEulerScheduler
from dicache.models.krea2.text import Krea2TextEncoder
from dicache.models.krea2.transformer import Krea2Transformer, TextConditioning
from dicache.models.krea2.vae import QwenImageVAEDecoder
from dicache.models.loading import (
    CheckpointError,
    check_load_format,
    default_dtype,
    read_json,
    resolve_component_dir,
)
from dicache.quantization import QuantizationSpec, parse_quantization, quantize_transformer

EMBEDDED_CHECKPOINT = pathlib.Path(__file__).resolve().parents[2] / "assets" / "krea2-tiny"
"""The small trained Krea-2-architecture checkpoint shipped with dicache (the default model)."""
EMBEDDED_TURBO_CHECKPOINT = EMBEDDED_CHECKPOINT.with_name("krea2-tiny-turbo")
"""Its distilled 8-step, CFG-free student (transformer and scheduler; the rest comes from `EMBEDDED_CHECKPOINT`)."""


@dataclass(frozen=True)
class Preset:
    num_inference_steps: int
    guidance_scale: float
    mu: float | None  # None: resolution-aware shift


PRESETS: dict[str, Preset] = {
    "turbo": Preset(num_inference_steps=8, guidance_scale=1.0, mu=TURBO_MU),
    "raw": Preset(num_inference_steps=50, guidance_scale=4.5, mu=None),
}
OUTPUT_TYPES = ("pil", "np", "pt", "latent")


def resolve_variant(pipe: Any, variant: str | None) -> str:
    """`variant` checked against `PRESETS`, or, when None, the checkpoint's own: turbo if distilled, else raw."""
    variant = variant or ("turbo" if getattr(pipe, "is_distilled", False) else "raw")
    if variant not in PRESETS:
        raise ValueError(f"variant={variant!r} is invalid: must be one of {', '.join(PRESETS)}")
    return variant


def guided_velocity(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance with the standard scale s: v_cond + (s - 1) (v_cond - v_uncond)."""
    return cond + (guidance_scale - 1.0) * (cond - uncond)


@dataclass
class Krea2PipelineOutput:
    """`images`: list of PIL images, a `(B, H, W, 3)` float array in [0, 1] (np), a `(B, 3, H, W)` tensor (pt), or
    packed latents `(B, N, C·p²)` (latent). `latents`: the final packed latents (always)."""

    images: Any
    latents: torch.Tensor


def _null_scope(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class Krea2Pipeline:
    """Krea-2 text-to-image pipeline.

    Args:
        transformer: the denoiser.
        scheduler: the sampling schedule (stateless; safe across concurrent requests).
        vae: the latent decoder (None: only `output_type="latent"`).
        text_encoder: prompt encoder (None: pass `prompt_embeds`).
        patch_size: latent patch side packed into one token.
        is_distilled: a Turbo checkpoint (default variant "turbo"); else "raw".
        default_size: `(height, width)` when a call gives none.
    """

    request_scope: Callable[..., contextlib.AbstractContextManager] = staticmethod(_null_scope)
    call_scope: Callable[..., contextlib.AbstractContextManager] = staticmethod(_null_scope)

    def __init__(
        self,
        transformer: Krea2Transformer,
        scheduler: FlowMatchEulerScheduler | None = None,
        vae: QwenImageVAEDecoder | None = None,
        text_encoder: Krea2TextEncoder | None = None,
        patch_size: int = 2,
        is_distilled: bool = False,
        default_size: tuple[int, int] = (1024, 1024),
        sample_prompts: list[dict] | None = None,
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler or FlowMatchEulerScheduler()
        self.vae = vae
        self.text_encoder = text_encoder
        self.patch_size = patch_size
        self.is_distilled = is_distilled
        self.default_size = tuple(default_size)
        self.sample_prompts = sample_prompts or []
        self.progress = True
        self.source: str | None = None
        self.offload = None  # a dicache.offload.PipelineOffload once enable_offload ran

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | os.PathLike | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        base: str | os.PathLike | None = None,
        *,
        quantization: str | QuantizationSpec | None = None,
        compile: bool = False,
        load_format: str = "auto",
        dit_layerwise_offload: bool = False,
        dit_offload_prefetch_size: float = 0.0,
        dit_cpu_offload: bool = False,
        text_encoder_cpu_offload: bool = False,
        vae_cpu_offload: bool = False,
        pin_cpu_memory: bool = True,
        gpu_memory_budget: float | None = None,
        offload_limits: dict | None = None,
        **hub_kwargs: Any,
    ) -> Krea2Pipeline:
        """Load a diffusers-layout Krea-2 folder or hub repo (None: the embedded checkpoint).

        Reads `model_index.json` (is_distilled, patch_size, text-encoder taps) and each component's folder; an
        optional `dicache.json` beside it gives the default image size, sample prompts and, for a checkpoint that
        holds only what differs from another one (the embedded Turbo student), `base_checkpoint`: the folder (relative
        to this one) or hub repo whose tokenizer, text encoder and VAE fill the components this folder lacks. `base`
        overrides that pointer. dtype: bf16 on CUDA, fp32 on CPU by default. Components neither here nor in the base
        (no text encoder, no VAE) are left out.
        `load_format="dummy"` draws random weights from the component configs (no weight files read; for speed
        and memory measurements). `quantization="fp8"` and `compile=True` apply `quantize` and `compile` after
        loading (for a model split over GPUs, call them yourself after `dicache.parallel.parallelize_pipeline`).

        The offload options (SGLang's names, see `enable_offload`) load the weights into host memory first and then
        place them as the memory plan says; `offload_limits` passes `enable_offload`'s size bounds (max_height,
        max_width, max_images, cfg, size_source, cache_config).
        """
        if path_or_repo_id is None:
            path_or_repo_id = EMBEDDED_CHECKPOINT
            if not EMBEDDED_CHECKPOINT.is_dir():
                raise CheckpointError(f"the embedded checkpoint is missing: {EMBEDDED_CHECKPOINT} is not a directory")
        device = torch.device(device) if device is not None else torch.device("cpu")
        dtype = dtype or default_dtype(device)
        from dicache.offload.plan import OffloadSettings

        offload = OffloadSettings(
            dit_layerwise_offload=dit_layerwise_offload,
            dit_offload_prefetch_size=dit_offload_prefetch_size,
            dit_cpu_offload=dit_cpu_offload,
            text_encoder_cpu_offload=text_encoder_cpu_offload,
            vae_cpu_offload=vae_cpu_offload,
            pin_cpu_memory=pin_cpu_memory,
            gpu_memory_budget=gpu_memory_budget,
        )
        target, device = device, (torch.device("cpu") if offload.any else device)  # offload: load on the host
        root = resolve_component_dir(path_or_repo_id, None, **hub_kwargs)
        index = read_json(root, "model_index.json")
        check_load_format(load_format)
        extras = _read_optional_json(root / "dicache.json")
        base_root = resolve_base_checkpoint(root, extras, base, **hub_kwargs)
        base_extras = _read_optional_json(base_root / "dicache.json") if base_root is not None else {}
        if base_root is not None:
            check_base_files(root, extras, base_root)

        def source(*names: str) -> str | os.PathLike | None:
            """Where components `names` load from: this checkpoint if it has them all, else the base (or None)."""
            if all((root / n).is_dir() for n in names):
                return path_or_repo_id
            return base_root

        transformer = Krea2Transformer.from_pretrained(
            path_or_repo_id, subfolder="transformer", dtype=dtype, device=device, load_format=load_format, **hub_kwargs
        )
        scheduler = FlowMatchEulerScheduler.from_pretrained(path_or_repo_id, subfolder="scheduler", **hub_kwargs)
        vae = None
        if _component_listed(index, "vae") and source("vae") is not None:
            vae = QwenImageVAEDecoder.from_pretrained(
                source("vae"), subfolder="vae", dtype=dtype, device=device, load_format=load_format, **hub_kwargs
            )
        text_encoder = None
        text_source = source("tokenizer", "text_encoder")
        if _component_listed(index, "text_encoder") and _component_listed(index, "tokenizer") and text_source:
            text_encoder = Krea2TextEncoder.from_pretrained(
                text_source, dtype=dtype, device=device, load_format=load_format, **hub_kwargs
            )
        size = extras.get("default_size", base_extras.get("default_size", [1024, 1024]))
        pipe = cls(
            transformer=transformer,
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            patch_size=int(index.get("patch_size", 2)),
            is_distilled=bool(index.get("is_distilled", False)),
            default_size=(int(size[0]), int(size[1])),
            sample_prompts=extras.get("sample_prompts", base_extras.get("sample_prompts")),
        )
        pipe.source = str(path_or_repo_id)
        # order: quantize (the memory plan reads the weights' actual bytes), plan and place, compile
        if offload.any:
            if quantization is not None:
                from dicache.offload.pipeline import quantize_through_device

                quantize_through_device(pipe, quantization, target)
            pipe._install_offload(offload, device=target, **(offload_limits or {}))
        elif quantization is not None:
            pipe.quantize(quantization)
        if compile:
            pipe.compile()
        return pipe

    # ------------------------------------------------------------------ speed
    def quantize(self, quantization: str | QuantizationSpec) -> list[str]:
        """Quantise the transformer in place (`"fp8"` or a `QuantizationSpec`); returns the quantised linears.

        Raises `QuantizationError` where FP8 cannot run (CPU, GPU below compute capability 8.9, no torchao).
        """
        spec = parse_quantization(quantization) if isinstance(quantization, str) else quantization
        if spec is None:
            return []
        return quantize_transformer(self.transformer, spec)

    def compile(self, *, dynamic: bool | None = None, backend: str = "inductor") -> Krea2Pipeline:
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
        from dicache.offload.plan import OffloadSettings

        settings = OffloadSettings(
            dit_layerwise_offload=dit_layerwise_offload,
            dit_offload_prefetch_size=dit_offload_prefetch_size,
            dit_cpu_offload=dit_cpu_offload,
            text_encoder_cpu_offload=text_encoder_cpu_offload,
            vae_cpu_offload=vae_cpu_offload,
            pin_cpu_memory=pin_cpu_memory,
            gpu_memory_budget=gpu_memory_budget,
        )
        return self._install_offload(
            settings,
            device=device,
            max_height=max_height,
            max_width=max_width,
            max_images=max_images,
            cfg=cfg,
            size_source=size_source,
            cache_config=cache_config,
        )

    def _install_offload(
        self,
        settings: Any,
        *,
        device: str | torch.device | None = None,
        max_height: int | None = None,
        max_width: int | None = None,
        max_images: int = 1,
        cfg: bool | None = None,
        size_source: str = "",
        cache_config: Any = None,
    ):
        """`enable_offload` with already validated `OffloadSettings` (what `from_pretrained` built once)."""
        from dicache.offload.pipeline import enable_pipeline_offload

        handle = enable_pipeline_offload(
            self,
            settings,
            device,
            max_height,
            max_width,
            max_images,
            cfg,
            size_source=size_source,
            cache_config=cache_config,
        )
        return handle.plan

    def disable_offload(self) -> None:
        """Stop offloading: streamed / offloaded weights stay in host memory, the rest on the device."""
        if self.offload is not None:
            self.offload.remove()

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def vae_scale_factor(self) -> int:
        return self.vae.scale_factor if self.vae is not None else 8

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this (VAE factor × patch size; 16 for Krea-2)."""
        return self.vae_scale_factor * self.patch_size

    def set_progress_bar_config(self, disable: bool = False) -> None:
        self.progress = not disable

    # ------------------------------------------------------------------ text
    def encode_prompt(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.text_encoder is None:
            raise ValueError("this pipeline has no text encoder: pass prompt_embeds and prompt_embeds_mask")
        return self.text_encoder.encode(prompts)

    def text_conditioning(self, embeds: torch.Tensor, mask: torch.Tensor | None, repeat: int) -> TextConditioning:
        """Text fusion + projection once per request and branch; rows repeated for several images per prompt."""
        if repeat > 1:
            embeds = embeds.repeat_interleave(repeat, dim=0)
            mask = mask.repeat_interleave(repeat, dim=0) if mask is not None else None
        with torch.no_grad():
            return self.transformer.encode_text(embeds.to(self.device), None if mask is None else mask.to(self.device))

    # ------------------------------------------------------------------ latents
    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """Token grid `(rows, cols)` of an image; raises a clear error for sizes off the multiple."""
        m = self.size_multiple
        for name, value in (("height", height), ("width", width)):
            if not isinstance(value, int) or value < m or value % m:
                raise ValueError(f"{name}={value!r} is invalid: must be a positive multiple of {m}")
        return height // m, width // m

    def initial_latents(self, batch: int, height: int, width: int, generator: torch.Generator | None) -> torch.Tensor:
        """Gaussian noise `(B, N, C·p²)` in fp32, drawn as diffusers' Krea-2 pipeline draws it (then packed)."""
        channels = self.transformer.config.in_channels // self.patch_size**2
        lh, lw = height // self.vae_scale_factor, width // self.vae_scale_factor
        gen_device = generator.device if generator is not None else torch.device("cpu")
        noise = torch.randn((batch, channels, lh, lw), generator=generator, device=gen_device, dtype=torch.float32)
        return self.pack(noise.to(self.device))

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """`(B, C, h, w)` -> `(B, (h/p)(w/p), C·p²)`."""
        b, c, h, w = latents.shape
        p = self.patch_size
        x = latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def unpack(self, tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """`(B, N, C·p²)` -> `(B, C, h, w)`."""
        b, _, cp = tokens.shape
        p = self.patch_size
        rows, cols = height // self.size_multiple, width // self.size_multiple
        x = tokens.view(b, rows, cols, cp // (p * p), p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, cp // (p * p), rows * p, cols * p)

    @staticmethod
    def position_ids(rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """`(rows·cols, 3)` RoPE coordinates `(0, h, w)` of the image tokens (text tokens sit at the origin)."""
        ids = torch.zeros(rows, cols, 3, device=device)
        ids[..., 1] = torch.arange(rows, device=device)[:, None]
        ids[..., 2] = torch.arange(cols, device=device)[None, :]
        return ids.reshape(rows * cols, 3)

    # ------------------------------------------------------------------ sampling
    def sigmas(self, num_steps: int, image_tokens: int, variant: str) -> torch.Tensor:
        mu = PRESETS[variant].mu if variant == "turbo" or self.is_distilled else None
        if self.is_distilled:
            mu = TURBO_MU
        return self.scheduler.sigmas_for(num_steps, image_tokens, mu=mu)

    @torch.no_grad()
    def denoise(
        self,
        cond: TextConditioning,
        uncond: TextConditioning | None,
        latents: torch.Tensor,
        rows: int,
        cols: int,
        sigmas: torch.Tensor,
        guidance_scale: float,
        cfg_batched: bool = False,
    ) -> torch.Tensor:
        """Euler sampling of packed `latents` `(B, N, C·p²)` (fp32) over `sigmas` (N+1 values). Returns fp32 latents.

        With `uncond`, each step runs the cond and the uncond branch (two calls, or one batched call with
        `cfg_batched`) and combines them in the reference form `cond + (s − 1)·(cond − uncond)`.
        """
        positions = self.position_ids(rows, cols, latents.device)
        model_t = self.scheduler.model_timesteps(sigmas).to(latents.device)
        num_steps = len(sigmas) - 1
        step_sigmas = [float(s) for s in sigmas]
        both = TextConditioning.concat([cond, uncond]) if (uncond is not None and cfg_batched) else None
        batch = latents.shape[0]
        with self.request_scope(num_steps=num_steps, sigmas=step_sigmas[:-1]):
            for i in tqdm(range(num_steps), disable=not self.progress, desc="denoise", leave=False):
                sigma = step_sigmas[i]
                t = model_t[i].expand(batch)
                if both is not None:
                    with self.call_scope(i, "batched", sigma):
                        out = self.transformer(torch.cat([latents, latents]), both, t.repeat(2), positions)
                    velocity, uncond_velocity = out.chunk(2)
                else:
                    with self.call_scope(i, "cond", sigma):
                        velocity = self.transformer(latents, cond, t, positions)
                    uncond_velocity = None
                    if uncond is not None:
                        with self.call_scope(i, "uncond", sigma):
                            uncond_velocity = self.transformer(latents, uncond, t, positions)
                if uncond_velocity is not None:
                    velocity = guided_velocity(velocity, uncond_velocity, guidance_scale)
                latents = self.scheduler.step(velocity, latents, sigma, step_sigmas[i + 1])
        return latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int, output_type: str) -> Any:
        if output_type == "latent":
            return latents
        if self.vae is None:
            raise ValueError(f"output_type={output_type!r} needs a VAE; this pipeline has none (use 'latent')")
        images = self.vae.decode(self.unpack(latents, height, width).to(self.vae.dtype)).float()
        images = (images / 2 + 0.5).clamp(0, 1)
        if output_type == "pt":
            return images
        array = images.permute(0, 2, 3, 1).cpu().numpy()
        if output_type == "np":
            return array
        from PIL import Image

        return [Image.fromarray((a * 255).round().astype(np.uint8)) for a in array]

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
        num_images_per_prompt: int = 1,
        output_type: str = "pil",
        variant: str | None = None,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_mask: torch.Tensor | None = None,
        cfg_batched: bool | None = None,
    ) -> Krea2PipelineOutput:
        """Generate images. Unset steps/guidance come from `variant` (default: turbo for a distilled checkpoint,
        else raw); `guidance_scale` is the standard s (1 = no CFG, must be >= 1); `seed` seeds a CPU generator.
        `cfg_batched`: run cond and uncond in one transformer call per step (default: only with layerwise offload)."""
        variant = resolve_variant(self, variant)
        preset = PRESETS[variant]
        steps = preset.num_inference_steps if num_inference_steps is None else num_inference_steps
        scale = preset.guidance_scale if guidance_scale is None else float(guidance_scale)
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"num_inference_steps={steps!r} is invalid: must be an integer >= 1")
        if not scale >= 1.0:
            raise ValueError(f"guidance_scale={scale!r} is invalid: must be >= 1 (1 = no CFG; standard convention)")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r} is invalid: must be one of {', '.join(OUTPUT_TYPES)}")
        if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt={num_images_per_prompt!r} is invalid: must be an integer >= 1")
        height = height or self.default_size[0]
        width = width or self.default_size[1]
        rows, cols = self.latent_grid(height, width)

        if prompt_embeds is None and prompt is None:
            raise ValueError("pass a prompt (or prompt_embeds)")
        prompts = None if prompt_embeds is not None else ([prompt] if isinstance(prompt, str) else list(prompt))
        num_prompts = prompt_embeds.shape[0] if prompt_embeds is not None else len(prompts)
        if self.offload is not None:
            self.offload.check_request(height, width, num_prompts * num_images_per_prompt, scale > 1.0)
        if cfg_batched is None:
            cfg_batched = self.offload is not None and self.offload.cfg_batched
        # every prompt is encoded before any text conditioning: an offloaded text encoder comes in once per call
        if prompt_embeds is None:
            prompt_embeds, prompt_embeds_mask = self.encode_prompt(prompts)
        if scale > 1.0 and negative_prompt_embeds is None:
            negatives = negative_prompt if negative_prompt is not None else ""
            negatives = [negatives] * num_prompts if isinstance(negatives, str) else list(negatives)
            if len(negatives) != num_prompts:
                raise ValueError(
                    f"negative_prompt has {len(negatives)} entries; expected 1 or one per prompt ({num_prompts})"
                )
            negative_prompt_embeds, negative_prompt_embeds_mask = self.encode_prompt(negatives)
        cond = self.text_conditioning(prompt_embeds, prompt_embeds_mask, num_images_per_prompt)
        uncond = None
        if scale > 1.0:
            uncond = self.text_conditioning(negative_prompt_embeds, negative_prompt_embeds_mask, num_images_per_prompt)

        batch = num_prompts * num_images_per_prompt
        if latents is None:
            if generator is None and seed is not None:
                generator = torch.Generator("cpu").manual_seed(int(seed))
            latents = self.initial_latents(batch, height, width, generator)
        else:
            latents = latents.to(self.device, torch.float32)
        sigmas = self.sigmas(steps, rows * cols, variant)
        latents = self.denoise(cond, uncond, latents, rows, cols, sigmas, scale, cfg_batched)
        images = self.decode(latents, height, width, output_type)
        return Krea2PipelineOutput(images=images, latents=latents)


def default_checkpoint(variant: str | None) -> pathlib.Path:
    """The embedded checkpoint a command loads when no model is given: the Turbo student for `variant == "turbo"`,
    else the base (`raw`, or no variant). Raises `CheckpointError` when that folder is missing."""
    if variant == "turbo":
        if not (EMBEDDED_TURBO_CHECKPOINT / "model_index.json").is_file():
            raise CheckpointError(
                f"the embedded Turbo checkpoint is missing: {EMBEDDED_TURBO_CHECKPOINT} has no model_index.json "
                "(train it with scripts/train_turbo.py), or pass --model, or use --variant raw"
            )
        return EMBEDDED_TURBO_CHECKPOINT
    return EMBEDDED_CHECKPOINT


def resolve_model(model: str | os.PathLike | None, variant: str | None) -> str | os.PathLike:
    """`model` when given, else `default_checkpoint(variant)`: what `--model` / `--variant` of the commands load."""
    return model if model is not None else default_checkpoint(variant)


def resolve_base_checkpoint(
    root: pathlib.Path, extras: dict, base: str | os.PathLike | None = None, **hub_kwargs: Any
) -> pathlib.Path | None:
    """The local folder of the base checkpoint a partial checkpoint at `root` points to (None: it names none).

    `base` (a folder, relative to the working directory, or a hub repo id), else `extras["base_checkpoint"]` from
    `dicache.json` (a folder relative to `root`, or a hub repo id). A pointer that resolves nowhere raises
    `CheckpointError` naming the checkpoint, the pointer and the folder it looked for.
    """
    pointer = base if base is not None else extras.get("base_checkpoint")
    if pointer is None:
        return None
    if not isinstance(pointer, str | os.PathLike) or not os.fspath(pointer):
        raise CheckpointError(f"{root / 'dicache.json'}: base_checkpoint={pointer!r} must be a folder or repo id")
    text = os.fspath(pointer)
    local = pathlib.Path(os.path.expanduser(text))
    if base is None and not local.is_absolute():  # the pointer in dicache.json is relative to the checkpoint
        local = root / local
    if local.is_dir():
        return local.resolve()
    if text.startswith((".", "/", "~", "\\")):  # a path, not a hub repo id
        shared = ", ".join(extras.get("shared_components") or ["its missing components"])
        raise CheckpointError(
            f"checkpoint {root} takes {shared} from its base checkpoint {text!r} (dicache.json base_checkpoint), "
            f"but {local} does not exist; put the base there or pass base=... (another folder or a hub repo id)"
        )
    try:
        return resolve_component_dir(pointer, None, **hub_kwargs)
    except CheckpointError as err:
        raise CheckpointError(
            f"checkpoint {root} needs its base checkpoint {text!r} (dicache.json base_checkpoint), "
            f"which is neither a folder at {local} nor an available hub repo: {err}"
        ) from err


def component_fingerprint(directory: str | os.PathLike) -> str:
    """sha256 over the names and bytes of a component folder's `*.safetensors` files (sorted; shards included)."""
    import hashlib

    digest = hashlib.sha256()
    files = sorted(pathlib.Path(directory).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {directory}")
    for file in files:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def check_base_files(root: pathlib.Path, extras: dict, base_root: pathlib.Path) -> None:
    """With `extras["base_files_sha256"]` (component -> `component_fingerprint` recorded at distillation), raise
    `CheckpointError` if the base's weights differ: the student only works with the components it was trained with."""
    for component, digest in (extras.get("base_files_sha256") or {}).items():
        if (root / component).is_dir():
            continue  # this checkpoint has its own copy
        found = component_fingerprint(base_root / component)
        if found != digest:
            raise CheckpointError(
                f"checkpoint {root} was distilled with a different {component}: the weights in "
                f"{base_root / component} have sha256 {found[:12]}…, its dicache.json base_files_sha256 expects "
                f"{str(digest)[:12]}…; use the base checkpoint it was trained with"
            )


def heldout_prompts_file(model: str | os.PathLike | None) -> pathlib.Path:
    """`heldout_prompts.json` of a local checkpoint (None: the embedded one), else of its base; may not exist."""
    root = pathlib.Path(model) if model is not None else EMBEDDED_CHECKPOINT
    own = root / "heldout_prompts.json"
    if own.is_file() or not root.is_dir():
        return own
    try:
        base = resolve_base_checkpoint(root, read_dicache_json(root))
    except CheckpointError:
        return own
    return base / "heldout_prompts.json" if base is not None else own


def read_dicache_json(root: str | os.PathLike) -> dict:
    """dicache's metadata `dicache.json` of a local checkpoint folder (`{}` when it has none)."""
    return _read_optional_json(pathlib.Path(root) / "dicache.json")


def _component_listed(index: dict, name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, list | tuple) and len(entry) == 2 and entry[0] is not None and entry[1] is not None


def _read_optional_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
