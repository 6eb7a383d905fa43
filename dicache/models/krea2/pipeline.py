"""Krea-2 text-to-image: prompts -> text conditioning -> flow-match Euler denoising -> VAE decode.

`Krea2Pipeline` holds the components and runs the sampling loop; the conventions it follows live beside it:
`presets` (variants, guidance formula), `checkpoints` (what `from_pretrained` reads), `latents` (token layout and
image outputs). Their names are re-exported here, where most callers import them from.

Model code has no cache logic. Two neutral seams let a cache engine observe the loop: `request_scope(num_steps,
sigmas)` around one generation, `call_scope(step, branch, sigma)` around each transformer call, where `branch` is
"cond", "uncond" or "batched" (cond and uncond in one batch). Callers observe or steer the loop through
`__call__`'s `callback_on_step_end` (diffusers' contract) and stop it through `interrupt` or by raising from the
callback; neither needs a seam to be wrapped.

Memory (small GPUs): `enable_offload(...)` (or the same options on `from_pretrained`) installs `dicache.offload`'s
planner and offloaders through Krea-2's memory glue (`memory`: the components, their phases, the bytes a request
needs, CFG batching under offload). A call runs its phases in order (encode every prompt, text conditioning,
denoise, decode) so an offloaded component is brought in once per call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from dicache.models.krea2 import attention_plans, memory
from dicache.models.krea2 import latents as layout
from dicache.models.krea2.callbacks import StepCallback, callback_inputs, run_callback
from dicache.models.krea2.checkpoints import (
    EMBEDDED_CHECKPOINT,
    EMBEDDED_TURBO_CHECKPOINT,
    check_base_files,
    component_fingerprint,
    default_checkpoint,
    heldout_prompts_file,
    load_components,
    read_dicache_json,
    resolve_base_checkpoint,
    resolve_model,
)
from dicache.models.krea2.optimizations import PipelineOptimizations
from dicache.models.krea2.presets import OUTPUT_TYPES, PRESETS, Preset, guided_velocity, resolve_variant, schedule_mu
from dicache.models.krea2.scheduler import FlowMatchEulerScheduler
from dicache.models.krea2.text import Krea2TextEncoder
from dicache.models.krea2.transformer import Krea2Transformer, TextConditioning
from dicache.models.krea2.vae import QwenImageVAEDecoder
from dicache.models.loading import CheckpointError, default_dtype
from dicache.offload.settings import OffloadLimits, OffloadSettings
from dicache.quantization import QuantizationError, QuantizationSpec, parse_quantization

__all__ = [
    "EMBEDDED_CHECKPOINT",
    "EMBEDDED_TURBO_CHECKPOINT",
    "OUTPUT_TYPES",
    "CallPlan",
    "PRESETS",
    "Krea2Pipeline",
    "Krea2PipelineOutput",
    "Preset",
    "StepCallback",
    "check_base_files",
    "component_fingerprint",
    "default_checkpoint",
    "guided_velocity",
    "heldout_prompts_file",
    "read_dicache_json",
    "resolve_base_checkpoint",
    "resolve_model",
    "resolve_variant",
]


@dataclass
class Krea2PipelineOutput:
    """`images`: list of PIL images, a `(B, H, W, 3)` float array in [0, 1] (np), a `(B, 3, H, W)` tensor (pt), or
    packed latents `(B, N, C·p²)` (latent). `latents`: the final packed latents (always)."""

    images: Any
    latents: torch.Tensor


@dataclass(frozen=True)
class CallPlan:
    """One call's resolved arguments (`Krea2Pipeline.plan_call`): image size and token grid, schedule, guidance,
    batch (`num_prompts · num_images_per_prompt` rows) and how CFG runs."""

    height: int
    width: int
    rows: int
    cols: int
    steps: int
    guidance_scale: float
    variant: str
    num_prompts: int
    num_images_per_prompt: int
    cfg_batched: bool
    output_type: str

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0

    @property
    def batch(self) -> int:
        return self.num_prompts * self.num_images_per_prompt


def _null_scope(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class Krea2Pipeline(PipelineOptimizations):
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
    _callback_tensor_inputs = ["latents"]  # what `callback_on_step_end` may read and replace
    _interrupt = False

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
        attention_plans.share()  # before the first attention call: one cuDNN plan for every prompt length
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
        text_encoder_quantization: str | None = None,
        compile: bool = False,
        load_format: str = "auto",
        offload_settings: OffloadSettings | None = None,
        offload_limits: OffloadLimits | None = None,
        cache_config: Any = None,
        weight_store: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> Krea2Pipeline:
        """Load a diffusers-layout Krea-2 folder or hub repo (None: the embedded checkpoint).

        Reads `model_index.json` (is_distilled, patch_size, text-encoder taps) and each component's folder; an
        optional `dicache.json` beside it gives the default image size, sample prompts and, for a checkpoint that
        holds only what differs from another one (the embedded Turbo student), `base_checkpoint`: the folder (relative
        to this one) or hub repo whose tokenizer, text encoder and VAE fill the components this folder lacks. `base`
        overrides that pointer. dtype: bf16 on CUDA, fp32 on CPU by default. Components neither here nor in the base
        (no text encoder, no VAE) are left out.
        `load_format="dummy"` draws random weights from the component configs (no weight files read; for speed
        and memory measurements). `quantization="fp8"` quantises each transformer block as soon as its weights are
        read, and `text_encoder_quantization` (`quantize_text_encoder`'s methods) the text encoder right after it
        loads, so that loading never holds the bf16 model whole; the same model as `quantize` after loading.
        `weight_store` (a compile-artifact folder, `--compile-artifact`): the quantised transformer is read from its
        snapshot there when one fits this checkpoint and quantisation, else quantised and saved there
        (`checkpoints.load_components`; the outcomes in `weight_snapshots`). `compile=True` applies `compile` after
        loading (for a model split over GPUs, load it unquantised and call
        `quantize` and `compile` yourself after `dicache.parallel.parallelize_pipeline`). `load_timings` then holds
        the seconds spent reading weights and quantising (`weights`, `quantization`), `load_reads` each component's
        read seconds and file bytes (`load_components`).

        Memory: `offload_settings`, or the same options by name among the keyword arguments (SGLang's names,
        `dit_layerwise_offload=True, text_encoder_cpu_offload=True, ...`: the fields of `OffloadSettings`), load the
        weights into host memory first and then place them as the memory plan says (`enable_offload`);
        `offload_limits` bounds the largest request the plan holds, `cache_config` the cache settings requests will
        use (default: the environment's). The other keyword arguments go to the hub download.
        """
        if path_or_repo_id is None:
            path_or_repo_id = EMBEDDED_CHECKPOINT
            if not EMBEDDED_CHECKPOINT.is_dir():
                raise CheckpointError(f"the embedded checkpoint is missing: {EMBEDDED_CHECKPOINT} is not a directory")
        device = torch.device(device) if device is not None else torch.device("cpu")
        dtype = dtype or default_dtype(device)
        named = {k: kwargs.pop(k) for k in list(kwargs) if k in OffloadSettings.model_fields}
        offload = OffloadSettings.given(offload_settings, named)
        target, device = device, (torch.device("cpu") if offload.any else device)  # offload: load on the host
        spec = parse_quantization(quantization) if isinstance(quantization, str) else quantization
        if text_encoder_quantization is not None and offload.any:
            raise QuantizationError("text_encoder_quantization cannot be combined with the memory (offload) options")
        timings: dict[str, float] = {}
        reads: dict[str, dict[str, float]] = {}
        snapshots: dict[str, dict[str, Any]] = {}
        pipe = cls(
            **load_components(
                path_or_repo_id,
                dtype,
                device,
                base,
                load_format,
                quantization=None if offload.any else spec,  # resident: each block quantised as it is read
                text_encoder_quantization=text_encoder_quantization,
                timings=timings,
                reads=reads,
                weight_store=None if offload.any else weight_store,
                snapshots=snapshots,
                **kwargs,
            )
        )
        pipe.source = str(path_or_repo_id)
        pipe.load_timings, pipe.load_reads, pipe.weight_snapshots = timings, reads, snapshots
        if text_encoder_quantization is not None:
            pipe.text_encoder_quantization = text_encoder_quantization
        # order: quantize (the memory plan reads the weights' actual bytes), plan and place, compile
        if offload.any:
            if spec is not None:
                memory.quantize_through_device(pipe, spec, target)
            memory.enable_offload(pipe, offload, offload_limits, target, cache_config)
        if compile:
            pipe.compile()
        return pipe

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
    def text_lengths(self) -> range:
        """Every count of real text tokens a prompt can give (`Krea2TextEncoder.num_valid_tokens`): from the empty
        prompt's (the template's suffix alone) to `max_sequence_length`."""
        if self.text_encoder is None:
            raise ValueError("this pipeline has no text encoder: its text lengths are unknown")
        return range(self.text_encoder.suffix_len, self.text_encoder.max_sequence_length + 1)

    def _grid_or_default(self, height: int | None, width: int | None) -> tuple[int, int]:
        """`latent_grid` at this size, the default size's height or width where one is None."""
        return self.latent_grid(height or self.default_size[0], width or self.default_size[1])

    def attention_plan_lengths(self, height: int | None = None, width: int | None = None) -> dict[int, int]:
        """Each prompt length (`text_lengths()`) -> the prompt length that stands for its cuDNN attention plan at this
        size (default: the default size): the longest whose joint sequence has the same plan. With shared plans
        (`attention_plans.shared()`, which the pipeline asks torch for) one or two lengths stand for all; otherwise
        each length for itself."""
        rows, cols = self._grid_or_default(height, width)
        return attention_plans.standing_for(self.text_lengths(), rows * cols, attention_plans.shared())

    def prepare_text_lengths(
        self, height: int | None = None, width: int | None = None, lengths: Iterable[int] | None = None
    ) -> int:
        """Meet every prompt length (or those in `lengths`, a part of `text_lengths()`) once at this size (default:
        the default size), on this thread, so that no request pays a length's first-call set-up
        (`Krea2Transformer.prepare_text_lengths`). Returns the number of lengths met."""
        rows, cols = self._grid_or_default(height, width)
        positions = self.position_ids(rows, cols, self.device)[-rows * cols :]
        every = self.text_lengths()
        if lengths is None:
            lengths = every
        else:
            lengths = list(lengths)
            outside = [n for n in lengths if n not in every]
            if outside:
                raise ValueError(
                    f"prepare_text_lengths: lengths {outside} are not prompt lengths ({every.start}..{every.stop - 1})"
                )
        return self.transformer.prepare_text_lengths(positions, lengths)

    def encode_prompt(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> `(embeds (B, L, layers, D) on the text encoder's device, mask (B, L) bool)`. A
        `Krea2TextEncoder` hands the mask over on the host, where tokenizing made it, so that `text_conditioning` packs
        the real tokens without waiting for the encoder's GPU work; any other encoder (an object with
        `encode(prompts)`) returns its mask where it likes."""
        if self.text_encoder is None:
            raise ValueError("this pipeline has no text encoder: pass prompt_embeds and prompt_embeds_mask")
        if isinstance(self.text_encoder, Krea2TextEncoder):
            return self.text_encoder.encode(prompts, mask_on_host=True)
        return self.text_encoder.encode(prompts)

    def text_conditioning(self, embeds: torch.Tensor, mask: torch.Tensor | None, repeat: int) -> TextConditioning:
        """Text fusion + projection once per request and branch; rows repeated for several images per prompt."""
        if repeat > 1:
            embeds = embeds.repeat_interleave(repeat, dim=0)
            mask = mask.repeat_interleave(repeat, dim=0) if mask is not None else None
        with torch.no_grad():
            return self.transformer.encode_text(embeds.to(self.device), mask)  # the mask is read where it lies

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
        return layout.pack(latents, self.patch_size)

    def unpack(self, tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """`(B, N, C·p²)` -> `(B, C, h, w)`."""
        m = self.size_multiple
        return layout.unpack(tokens, height // m, width // m, self.patch_size)

    position_ids = staticmethod(layout.position_ids)

    # ------------------------------------------------------------------ sampling
    def sigmas(self, num_steps: int, image_tokens: int, variant: str) -> torch.Tensor:
        return self.scheduler.sigmas_for(num_steps, image_tokens, mu=schedule_mu(variant, self.is_distilled))

    @property
    def interrupt(self) -> bool:
        """Set `pipe._interrupt = True` (from `callback_on_step_end`) to skip the remaining steps, as in diffusers:
        the latents so far are decoded and returned. `__call__` clears it when it starts."""
        return self._interrupt

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
        *,
        callback_on_step_end: StepCallback | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    ) -> torch.Tensor:
        """Euler sampling of packed `latents` `(B, N, C·p²)` (fp32) over `sigmas` (N+1 values). Returns fp32 latents.

        With `uncond`, each step runs the cond and the uncond branch (two calls, or one batched call with
        `cfg_batched`) and combines them in the reference form `cond + (s − 1)·(cond − uncond)`. Before each step the
        loop ends if `interrupt` is set; after each step it runs `callback_on_step_end` (see `__call__`).
        """
        inputs = callback_inputs(callback_on_step_end, callback_on_step_end_tensor_inputs, self._callback_tensor_inputs)
        positions = self.position_ids(rows, cols, latents.device)
        model_t = self.scheduler.model_timesteps(sigmas).to(latents.device, non_blocking=True)  # queued, no wait
        timesteps = self.scheduler.timesteps(sigmas)
        num_steps = len(sigmas) - 1
        step_sigmas = [float(s) for s in sigmas]
        both = TextConditioning.concat([cond, uncond]) if (uncond is not None and cfg_batched) else None
        batch = latents.shape[0]
        with self.request_scope(num_steps=num_steps, sigmas=step_sigmas[:-1]):
            for i in tqdm(range(num_steps), disable=not self.progress, desc="denoise", leave=False):
                if self.interrupt:
                    break
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
                if callback_on_step_end is not None:
                    tensors = run_callback(callback_on_step_end, self, i, timesteps[i], inputs, {"latents": latents})
                    latents = tensors["latents"]
        return latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int, output_type: str) -> Any:
        if output_type == "latent":
            return latents
        if self.vae is None:
            raise ValueError(f"output_type={output_type!r} needs a VAE; this pipeline has none (use 'latent')")
        return layout.to_output(self.vae.decode(self.unpack(latents, height, width).to(self.vae.dtype)), output_type)

    # ------------------------------------------------------------------ a call, phase by phase
    def plan_call(
        self,
        num_prompts: int,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        num_images_per_prompt: int = 1,
        output_type: str = "pil",
        variant: str | None = None,
        cfg_batched: bool | None = None,
    ) -> CallPlan:
        """`__call__`'s arguments resolved and checked (defaults from `variant`, sizes against the VAE and patch
        multiple, the request against an offload plan); no model runs. Raises `ValueError` naming a bad argument."""
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
        batch = num_prompts * num_images_per_prompt
        if self.offload is not None:
            self.offload.check_request(height, width, batch, scale > 1.0)
        if cfg_batched is None:
            cfg_batched = self.offload is not None and self.offload.cfg_batched
        return CallPlan(
            height, width, rows, cols, steps, scale, variant, num_prompts, num_images_per_prompt, cfg_batched,
            output_type,
        )  # fmt: skip

    def condition(
        self,
        plan: CallPlan,
        prompts: list[str] | None,
        negative_prompt: str | list[str] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_mask: torch.Tensor | None = None,
    ) -> tuple[TextConditioning, TextConditioning | None]:
        """The text phase: `(cond, uncond)` for `plan` (uncond None without CFG). Every prompt is encoded before any
        text conditioning, so an offloaded text encoder comes in once per call."""
        if prompt_embeds is None:
            prompt_embeds, prompt_embeds_mask = self.encode_prompt(prompts)
        if plan.cfg and negative_prompt_embeds is None:
            negatives = negative_prompt if negative_prompt is not None else ""
            negatives = [negatives] * plan.num_prompts if isinstance(negatives, str) else list(negatives)
            if len(negatives) != plan.num_prompts:
                raise ValueError(
                    f"negative_prompt has {len(negatives)} entries; expected 1 or one per prompt ({plan.num_prompts})"
                )
            negative_prompt_embeds, negative_prompt_embeds_mask = self.encode_prompt(negatives)
        cond = self.text_conditioning(prompt_embeds, prompt_embeds_mask, plan.num_images_per_prompt)
        uncond = None
        if plan.cfg:
            uncond = self.text_conditioning(
                negative_prompt_embeds, negative_prompt_embeds_mask, plan.num_images_per_prompt
            )
        return cond, uncond

    def starting_latents(
        self,
        plan: CallPlan,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The noise `plan` starts from: `latents` (moved to the device, fp32) if given, else drawn from `generator`
        or, without one, from a CPU generator seeded with `seed`."""
        if latents is not None:
            return latents.to(self.device, torch.float32)
        if generator is None and seed is not None:
            generator = torch.Generator("cpu").manual_seed(int(seed))
        return self.initial_latents(plan.batch, plan.height, plan.width, generator)

    def run_denoise(
        self,
        plan: CallPlan,
        cond: TextConditioning,
        uncond: TextConditioning | None,
        latents: torch.Tensor,
        callback_on_step_end: StepCallback | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    ) -> torch.Tensor:
        """The denoising phase of `plan` (`denoise` over its schedule)."""
        sigmas = self.sigmas(plan.steps, plan.rows * plan.cols, plan.variant)
        return self.denoise(
            cond, uncond, latents, plan.rows, plan.cols, sigmas, plan.guidance_scale, plan.cfg_batched,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )  # fmt: skip

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
        callback_on_step_end: StepCallback | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    ) -> Krea2PipelineOutput:
        """Generate images. Unset steps/guidance come from `variant` (default: turbo for a distilled checkpoint,
        else raw); `guidance_scale` is the standard s (1 = no CFG, must be >= 1); `seed` seeds a CPU generator.
        `cfg_batched`: run cond and uncond in one transformer call per step (default: only with layerwise offload).

        `callback_on_step_end(pipe, step_index, timestep, callback_kwargs) -> dict`, as in diffusers: called after
        each denoising step with the step's index, its scheduler timestep (`sigma · 1000`, a 0-d tensor) and the
        tensors named in `callback_on_step_end_tensor_inputs` (a subset of `_callback_tensor_inputs`: "latents");
        a returned "latents" replaces the latents for the following steps and the output. To stop early, either set
        `pipe._interrupt = True` in the callback (diffusers' way: the remaining steps are skipped, the latents so far
        are decoded and returned), or raise: the exception leaves the call at once, nothing is decoded.

        The phases run in order and can be called one by one (the server runs them on separate threads):
        `plan_call`, `condition`, `starting_latents`, `run_denoise`, `decode`.
        """
        self._interrupt = False
        if prompt_embeds is None and prompt is None:
            raise ValueError("pass a prompt (or prompt_embeds)")
        prompts = None if prompt_embeds is not None else ([prompt] if isinstance(prompt, str) else list(prompt))
        num_prompts = prompt_embeds.shape[0] if prompt_embeds is not None else len(prompts)
        plan = self.plan_call(
            num_prompts, height, width, num_inference_steps, guidance_scale, num_images_per_prompt, output_type,
            variant, cfg_batched,
        )  # fmt: skip
        cond, uncond = self.condition(
            plan, prompts, negative_prompt, prompt_embeds, prompt_embeds_mask, negative_prompt_embeds,
            negative_prompt_embeds_mask,
        )  # fmt: skip
        latents = self.starting_latents(plan, seed, generator, latents)
        latents = self.run_denoise(
            plan, cond, uncond, latents, callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        images = self.decode(latents, plan.height, plan.width, plan.output_type)
        return Krea2PipelineOutput(images=images, latents=latents)
