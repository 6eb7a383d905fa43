"""Generate one image and measure it: a pipeline plain or cached by dicache, the one sampler of `dicache sweep` and
`dicache calibrate`.

`NativeRunner` runs our Krea-2 pipeline; `FamilyRunner`, the same runner on a diffusers pipeline of a registered
family, calls the pipeline's own `__call__` (seed through its `generator`, guidance as the family takes it:
`dicache.models.families.call_kwargs`); its fewer-steps baseline is the same pipeline with fewer steps. A runner's
`generate(...)` returns a `Sample`: the image, the final latents, timings and how many transformer blocks ran;
`check_schedule` refuses, before any run, a schedule the model cannot take. `runner_for(pipe)` picks the runner of a
pipeline built in Python. The cache-dit side has the same interface in `cachedit.py`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import dicache

from ..engine.adapters.families import stack_spec
from ..errors import ConfigError
from ..models.families import (
    FamilyModel,
    call_kwargs,
    fitted_refusal,
    guidance_refusal,
    load_family_model,
    step_mask_refusal,
    wrap_pipeline,
)
from ..models.krea2 import Krea2Pipeline
from ..models.krea2.presets import resolve_variant
from ..settings.cache_config import CacheConfig
from . import solvers
from .spec import Schedule

FLAT_STD = 0.01
"""A reference image whose pixels vary less than this (std over the image, in [0, 1]) is flat: a tiny untrained
VAE's. Fidelity is then measured on the final latents (`FamilyRunner.measured_on`)."""
LATENT_PEAK = 8.0
"""Latents are compared as `0.5 + latents / LATENT_PEAK`: PSNR with a peak-to-peak of 8, the ±4σ range of unit
variance latents."""


@dataclass
class Sample:
    """One generated image and what it cost.

    image: `(3, H, W)` float32 in [0, 1], CPU. latents: final packed latents `(N, C·p²)` float32, CPU.
    denoise_s: seconds from the first transformer call's start to the last one's end; total_s: the whole pipeline
    call (text encoding, denoising, VAE decode). calls: transformer calls made; cached_calls: calls whose middle blocks
    were skipped; blocks_run: transformer blocks evaluated over all calls; full_calls: calls of the uncached run of the
    schedule (steps × CFG branches), the denominator of the compute fraction.
    """

    image: torch.Tensor
    latents: torch.Tensor
    denoise_s: float
    total_s: float
    calls: int
    cached_calls: int
    blocks_run: float
    num_blocks: int
    image_tokens: int
    text_tokens: int
    cached_steps: dict[str, list[int]] = field(default_factory=dict)
    full_calls: int | None = None

    @property
    def compute_fraction(self) -> float:
        """Transformer blocks run / blocks of the uncached run of the schedule (`full_calls` = its steps × CFG branches;
        None: the calls made). Only blocks that ran count, so a call that runs no block (whole-step reuse, Fn = 0)
        adds nothing, and fewer-steps or step-reuse baselines are in the same units."""
        full = self.calls if self.full_calls is None else self.full_calls
        return block_fraction(self.blocks_run, self.num_blocks, full)


def block_fraction(blocks_run: float, num_blocks: int, full_calls: int) -> float:
    """`blocks_run / (num_blocks × full_calls)`: compute against an uncached run of `full_calls` transformer calls
    (steps × CFG branches); 1.0 when there are no calls."""
    return blocks_run / (num_blocks * full_calls) if full_calls else 1.0


def branches(schedule: Schedule) -> int:
    """Transformer calls per step of an uncached, unbatched run: 2 with CFG, else 1."""
    return 2 if schedule.cfg else 1


def recorded_sample(
    rec: CallRecorder,
    schedule: Schedule,
    image: torch.Tensor,
    latents: torch.Tensor,
    num_blocks: int,
    *,
    cached_calls: int = 0,
    blocks_run: float | None = None,
    cached_steps: dict[str, list[int]] | None = None,
    full_calls: int | None = None,
) -> Sample:
    """The `Sample` of one generation that `rec` recorded: `image` / `latents` copied to float32 on the CPU;
    `blocks_run` None: every block of every call ran (uncached); `full_calls` the schedule's uncached calls (None:
    steps × CFG branches)."""
    return Sample(
        image=image.detach().float().cpu(),
        latents=latents.detach().float().cpu(),
        denoise_s=rec.denoise_s,
        total_s=rec.total_s,
        calls=rec.calls,
        cached_calls=cached_calls,
        blocks_run=rec.calls * num_blocks if blocks_run is None else blocks_run,
        num_blocks=num_blocks,
        image_tokens=rec.image_tokens,
        text_tokens=rec.text_tokens,
        cached_steps=cached_steps or {},
        full_calls=schedule.steps * branches(schedule) if full_calls is None else full_calls,
    )


class CallRecorder:
    """Counts a module's calls, times the first start to the last end, and reads token counts from the first call.

    On CUDA the device is synchronised at the first call's start and at every call's end, so times are real.
    `total_s`: seconds inside the `with` block (the whole pipeline call). Token counts: `hidden_states` (positional 0
    or keyword) `(B, N, C)` gives N image tokens; `encoder_hidden_states` (positional 1 or keyword) gives the text
    tokens: `.num_tokens` when it has one (native, padding dropped), else its dim 1 (diffusers, padded).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.calls = 0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.image_tokens = 0
        self.text_tokens = 0
        self.total_s = 0.0
        self._entered = 0.0
        self._handles: list[Any] = []

    def __enter__(self) -> CallRecorder:
        self._handles = [
            self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.module.register_forward_hook(self._post),
        ]
        self._entered = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.total_s = time.perf_counter() - self._entered
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _sync(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.first_start is None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self._sync(hidden)
            self.first_start = time.perf_counter()
            text = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
            if isinstance(hidden, torch.Tensor) and hidden.ndim == 3:
                self.image_tokens = int(hidden.shape[1])
            if hasattr(text, "num_tokens"):
                self.text_tokens = int(text.num_tokens)
            elif isinstance(text, torch.Tensor) and text.ndim >= 2:
                self.text_tokens = int(text.shape[1])
        self.calls += 1

    def _post(self, module: Any, args: tuple, output: Any) -> None:
        self._sync(output[0] if isinstance(output, tuple | list) else getattr(output, "sample", output))
        self.last_end = time.perf_counter()

    @property
    def denoise_s(self) -> float:
        if self.first_start is None or self.last_end is None:
            return 0.0
        return self.last_end - self.first_start


class NativeRunner:
    """`dicache.models.krea2.Krea2Pipeline`, plain (`cache=None`) or with `dicache.enable(pipe, cache)`.

    The text path runs once per request and branch (not per call), which `text_per_call = False` tells the FLOPs
    estimate.
    """

    pipeline = "native"
    text_per_call = False

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.pipe.set_progress_bar_config(disable=True)

    @classmethod
    def load(
        cls,
        model: str | None,
        dtype: torch.dtype = torch.float32,
        device: str | None = None,
        quantization: str | None = None,
    ) -> NativeRunner:
        return cls(Krea2Pipeline.from_pretrained(model, dtype=dtype, device=device, quantization=quantization))

    @property
    def transformer_config(self) -> Any:
        return self.pipe.transformer.config

    @property
    def num_blocks(self) -> int:
        return len(self.pipe.transformer.transformer_blocks)

    @property
    def default_size(self) -> tuple[int, int]:
        return tuple(self.pipe.default_size)

    @property
    def is_distilled(self) -> bool:
        return bool(self.pipe.is_distilled)

    def check_schedule(self, schedule: Schedule) -> None:
        """Refuse (`ConfigError`) a schedule this model cannot take, before any run."""
        if schedule.embedded_guidance is not None:
            raise ConfigError(
                f"embedded_guidance={schedule.embedded_guidance:g} is refused for Krea-2: it has no guidance "
                "embedding; CFG goes through the guidance scale"
            )

    def configure(self, cache: CacheConfig | None) -> None:
        """Enable dicache on the pipeline with `cache` (replacing any settings), or disable it (None)."""
        if cache is None:
            dicache.disable(self.pipe)
        else:
            dicache.enable(self.pipe, cache)  # replaces any previous settings

    def _call(
        self, prompt: str, seed: int, schedule: Schedule, steps: int, height: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One generation through the pipeline: (image `(3, H, W)` in [0, 1], final latents)."""
        out = self.pipe(
            prompt,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=schedule.guidance_scale,
            seed=seed,
            output_type="pt",
            variant=schedule.variant,
        )
        return out.images[0], out.latents[0]

    def _full_calls(self, rec: CallRecorder, schedule: Schedule, steps: int) -> int | None:
        """Transformer calls of the uncached run of `schedule` (None: steps × CFG branches)."""
        return None

    def generate(
        self, prompt: str, seed: int, schedule: Schedule, steps: int, height: int, width: int, cache: CacheConfig | None
    ) -> Sample:
        """One image of `prompt` with `seed` at `steps` steps and the schedule's CFG, cached with `cache` (or not)."""
        self.configure(cache)
        with CallRecorder(self.pipe.transformer) as rec:
            image, latents = self._call(prompt, seed, schedule, steps, height, width)
        full = self._full_calls(rec, schedule, steps)
        if cache is None:
            return recorded_sample(rec, schedule, image, latents, self.num_blocks, full_calls=full)
        stats = dicache.stats(self.pipe)
        return recorded_sample(
            rec,
            schedule,
            image,
            latents,
            self.num_blocks,
            cached_calls=stats.cached_calls,
            blocks_run=stats.blocks_run,
            cached_steps={name: list(b.cached_steps) for name, b in stats.branches.items()},
            full_calls=full,
        )

    def generate_batch(
        self, samples: list[tuple[str, int]], schedule: Schedule, height: int, width: int, cache: CacheConfig | None
    ) -> torch.Tensor:
        """All `samples` (prompt, seed) as one batch, each row from its seed's noise (as `generate` draws it),
        uncached or cached with `cache`; the final packed latents `(B, N, C)` (the fitted predictor's fit)."""
        pipe = self.pipe
        plan = pipe.plan_call(1, height, width, schedule.steps, schedule.guidance_scale, variant=schedule.variant)
        latents = torch.cat([pipe.starting_latents(plan, seed) for _, seed in samples])
        self.configure(cache)
        out = pipe(
            [prompt for prompt, _ in samples],
            height=height,
            width=width,
            num_inference_steps=schedule.steps,
            guidance_scale=schedule.guidance_scale,
            latents=latents,
            output_type="latent",
            variant=schedule.variant,
        )
        return out.latents

    def step_sizes(self, schedule: Schedule, height: int, width: int) -> list[float]:
        """`σ(i + 1) − σ(i)` of each step of `schedule` at this size: the Euler step the pipeline takes."""
        pipe = self.pipe
        rows, cols = pipe.latent_grid(height, width)
        variant = resolve_variant(pipe, schedule.variant)
        sigmas = [float(s) for s in pipe.sigmas(schedule.steps, rows * cols, variant)]
        return [b - a for a, b in zip(sigmas, sigmas[1:])]

    def generate_baseline(
        self, prompt: str, seed: int, schedule: Schedule, kind: str, count: int, height: int, width: int
    ) -> Sample:
        """One image of a same-compute baseline (`dicache.sweep.solvers`: `euler` / `heun` with `count` steps,
        `curved` computing `curved_steps(schedule.steps, count)`), uncached, measured like `generate`."""
        self.configure(None)
        with CallRecorder(self.pipe.transformer) as rec:
            run = solvers.sample(
                self.pipe,
                prompt,
                seed,
                kind=kind,
                n=schedule.steps,
                count=count,
                guidance_scale=schedule.guidance_scale,
                height=height,
                width=width,
                variant=schedule.variant,
            )
            image = self.pipe.decode(run.latents, height, width, "pt")[0]
        return recorded_sample(rec, schedule, image, run.latents[0], self.num_blocks)


class FamilyRunner(NativeRunner):
    """`NativeRunner` on a diffusers pipeline of a registered family (`dicache.models.families.FamilyModel`).

    Generation is the pipeline's own `__call__` (`call_kwargs`: seed, steps, guidance as the family takes it, the
    checkpoint's `call` extras; the final latents read at the last step's callback). The fewer-steps baseline is
    the same call with fewer steps; Heun and `curved` need Krea-2's pipeline pieces and are refused. Compute is
    counted over the family's whole block stack (every list). `measured_on`: "image", or "latents" when the first
    uncached image is flat (`FLAT_STD`; then every image of the run is its latents' view, `LATENT_PEAK`).
    `exclusive`: another runner on the same pipeline (cache-dit's), closed before each generation."""

    text_per_call = True

    def __init__(self, model: FamilyModel | Any) -> None:
        self.model = model if isinstance(model, FamilyModel) else wrap_pipeline(model)
        self.pipe = self.model.pipe
        self.pipe.set_progress_bar_config(disable=True)
        self.measured_on: str | None = None
        self.exclusive: Any = None
        self._takes_callback = "callback_on_step_end" in inspect.signature(type(self.pipe).__call__).parameters
        self._sigmas: dict[tuple[int, int, int], list[float]] = {}

    @classmethod
    def load(
        cls,
        model: str | None,
        dtype: torch.dtype = torch.float32,
        device: str | None = None,
        quantization: str | None = None,
    ) -> FamilyRunner:
        if quantization:
            raise ConfigError(f"quantization={quantization!r} is refused for {model}: only Krea-2 has it")
        return cls(load_family_model(model, dtype=dtype, device=device))

    @property
    def num_blocks(self) -> int:
        return stack_spec(self.pipe.transformer).num_blocks

    @property
    def default_size(self) -> tuple[int, int]:
        return self.model.default_size

    @property
    def is_distilled(self) -> bool:
        return False

    def check_schedule(self, schedule: Schedule) -> None:
        if schedule.variant is not None:
            raise ConfigError(
                f"variant={schedule.variant!r} is refused for {self.model.name}: variants are Krea-2's presets"
            )
        reason = guidance_refusal(self.model, schedule.guidance_scale, schedule.embedded_guidance)
        if reason is not None:
            raise ConfigError(reason)

    def mask_refusal(self, steps: int) -> str | None:
        """Why a step mask cannot apply at `steps` steps (the scheduler's step count), or None."""
        return step_mask_refusal(self.model, steps)

    def fitted_refusal(self, schedule: Schedule) -> str | None:
        """Why the fitted output predictor (`cached_step_method=fitted`) cannot be fitted or run at `schedule`
        (`dicache.models.families.fitted_refusal`), or None."""
        return fitted_refusal(self.model, schedule.steps, schedule.guidance_scale)

    def configure(self, cache: CacheConfig | None) -> None:
        if self.exclusive is not None:
            self.exclusive.close()
        super().configure(cache)

    def call(
        self, prompt: str, seed: int, schedule: Schedule, steps: int, height: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One generation through the pipeline's `__call__`: (image or its latents' view, final latents)."""
        final: dict[str, torch.Tensor] = {}
        kwargs = call_kwargs(
            self.model,
            steps=steps,
            guidance=schedule.guidance_scale,
            embedded_guidance=schedule.embedded_guidance,
            height=height,
            width=width,
            seed=seed,
        )
        if self._takes_callback:

            def keep_latents(pipe: Any, i: int, t: Any, tensors: dict) -> dict:
                final["latents"] = tensors["latents"]
                return {}

            kwargs.update(callback_on_step_end=keep_latents, callback_on_step_end_tensor_inputs=["latents"])
        with torch.no_grad():
            out = self.pipe(prompt, output_type="pt", **kwargs)
        image = first_image(out)
        latents = final.get("latents", image[None])[0].detach().float().cpu()
        if self.measured_on is None:
            self.measured_on = "latents" if image.float().std().item() < FLAT_STD else "image"
        return (latent_view(latents) if self.measured_on == "latents" else image), latents

    _call = call

    def generate_batch(
        self, samples: list[tuple[str, int]], schedule: Schedule, height: int, width: int, cache: CacheConfig | None
    ) -> torch.Tensor:
        """All `samples` (prompt, seed) as one batch through the pipeline's `__call__`, a generator per row seeded
        as `generate` seeds it (so each row starts from its seed's noise), uncached or cached with `cache`; the
        final latents as the denoising loop holds them (read at the last step's callback: Flux's packed
        `(B, N, C)`, what the transformer takes). The scheduler's sigmas of the run are kept for `step_sizes`."""
        reason = self.fitted_refusal(schedule)
        if reason is not None:
            raise ConfigError(reason)
        kwargs = call_kwargs(
            self.model,
            steps=schedule.steps,
            guidance=schedule.guidance_scale,
            embedded_guidance=schedule.embedded_guidance,
            height=height,
            width=width,
            seed=0,
        )
        kwargs["generator"] = [torch.Generator("cpu").manual_seed(int(seed)) for _, seed in samples]
        if isinstance(kwargs.get("negative_prompt"), str):
            kwargs["negative_prompt"] = [kwargs["negative_prompt"]] * len(samples)
        final: dict[str, torch.Tensor] = {}

        def keep_latents(pipe: Any, i: int, t: Any, tensors: dict) -> dict:
            final["latents"] = tensors["latents"]
            return {}

        self.configure(cache)
        with torch.no_grad():
            self.pipe(
                [prompt for prompt, _ in samples],
                output_type="latent",
                callback_on_step_end=keep_latents,
                callback_on_step_end_tensor_inputs=["latents"],
                **kwargs,
            )
        sigmas = getattr(self.pipe.scheduler, "sigmas", None)
        if isinstance(sigmas, torch.Tensor) and len(sigmas) == schedule.steps + 1:
            self._sigmas[(schedule.steps, height, width)] = [float(s) for s in sigmas]
        return final["latents"]

    def step_sizes(self, schedule: Schedule, height: int, width: int) -> list[float]:
        """`σ(i + 1) − σ(i)` of each step, from the scheduler's sigmas of the last `generate_batch` at this step
        count and size (they depend on the image size through the schedule's shift: read, not recomputed)."""
        sigmas = self._sigmas.get((schedule.steps, height, width))
        if sigmas is None:
            raise RuntimeError(
                f"step_sizes of {self.model.name} at {schedule.steps} steps, {width}x{height} px: run generate_batch "
                "there first (the step sizes are read from the scheduler's sigmas of that run)"
            )
        return [b - a for a, b in zip(sigmas, sigmas[1:])]

    def _full_calls(self, rec: CallRecorder, schedule: Schedule, steps: int) -> int:
        """The calls an uncached run of the schedule makes: this run's calls (cached calls call the transformer
        too) scaled from `steps` to the schedule's steps."""
        return round(rec.calls * schedule.steps / steps)

    def generate_baseline(self, *args: Any, **kwargs: Any) -> Sample:
        raise ConfigError(f"the Heun and curved baselines are refused for {self.model.name}: they need Krea-2's pieces")


def first_image(output: Any) -> torch.Tensor:
    """A pipeline output's first image `(3, H, W)` float in [0, 1] (a video's frames side by side)."""
    value = next(getattr(output, name) for name in ("images", "frames", "image") if hasattr(output, name))
    image = torch.as_tensor(value[0]).float()
    if image.ndim == 4:  # (frames, 3, H, W)
        image = torch.cat(list(image), dim=-1)
    if image.ndim == 3 and image.shape[-1] == 3 and image.shape[0] != 3:  # numpy layout (H, W, 3)
        image = image.permute(2, 0, 1)
    return image.cpu()


def latent_view(latents: torch.Tensor) -> torch.Tensor:
    """Final latents as a 3-channel image for the image measures: `0.5 + latents / LATENT_PEAK` as one (rows, last
    dim) plane, repeated over 3 channels and enlarged (nearest) to at least 16 px a side (which leaves the MSE, and
    so the PSNR, unchanged)."""
    plane = latents.float().reshape(-1, latents.shape[-1])
    factor = max(1, -(-16 // min(plane.shape)))
    plane = plane.repeat_interleave(factor, 0).repeat_interleave(factor, 1)
    return (0.5 + plane / LATENT_PEAK)[None].expand(3, -1, -1).contiguous()


def runner_for(pipe: Any, call: Mapping[str, Any] | None = None) -> NativeRunner:
    """The runner of a pipeline built in Python: `NativeRunner` for our Krea-2, else `FamilyRunner` (`call`: extra
    keyword arguments of every call of a family's pipeline, e.g. `max_sequence_length`)."""
    if isinstance(pipe, Krea2Pipeline):
        if call:
            raise ConfigError(f"call={dict(call)!r} is refused for Krea-2: it is for a family's diffusers pipeline")
        return NativeRunner(pipe)
    return FamilyRunner(wrap_pipeline(pipe, call))
