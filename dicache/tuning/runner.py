"""Generating one calibration sample: the `Runner` protocol and `PipelineRunner`, the sweep's `NativeRunner` at the
calibration's fixed schedule and size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..settings.cache_config import CacheConfig
from ..sweep.runners import NativeRunner, runner_for
from ..sweep.spec import Schedule


@dataclass
class Measurement:
    """One generation: `image` `(3, H, W)` float in [0, 1]; `blocks_run` transformer blocks evaluated over all
    calls and branches; `blocks_total` the calls made x the model's blocks (for an uncached run: what it costs; a
    candidate's compute is measured against its uncached reference's `blocks_total`); `seconds` wall time."""

    image: torch.Tensor
    blocks_run: float
    blocks_total: int
    seconds: float


class Runner(Protocol):
    """Generates one sample at the calibration's fixed schedule and size, uncached (`config` None) or cached."""

    num_blocks: int
    steps: int

    def fitted_refusal(self) -> str | None:
        """Why the fitted output predictor cannot be fitted on this model at this schedule, or None (Krea-2 takes
        it; a family's pipeline: `FamilyRunner.fitted_refusal`)."""
        refusal = getattr(self.native, "fitted_refusal", None)
        return None if refusal is None else refusal(self.schedule)

    def run(self, prompt: str, seed: int, config: CacheConfig | None) -> Measurement: ...


class PipelineRunner:
    """`Runner` on a pipeline, our Krea-2 or a registered family's diffusers pipeline (or a sweep runner of one):
    the sweep's `NativeRunner` / `FamilyRunner` (one way to sample and count for both commands) at a fixed schedule
    and size; a schedule the model cannot take is refused here, before any run.

    Uncached runs have dicache disabled (the original forwards): `blocks_run = blocks_total = calls x num_blocks`.
    Cached runs enable dicache with the candidate's config; `blocks_run` is what dicache's statistics say ran
    (`RequestStats.blocks_run`, all branches)."""

    def __init__(
        self,
        pipe: Any,
        steps: int,
        guidance_scale: float,
        variant: str | None,
        height: int,
        width: int,
        embedded_guidance: float | None = None,
    ) -> None:
        self.native = pipe if isinstance(pipe, NativeRunner) else runner_for(pipe)
        self.schedule = Schedule(steps, guidance_scale, variant, embedded_guidance)
        self.native.check_schedule(self.schedule)  # refused before any run
        self.steps, self.height, self.width = steps, height, width
        self.num_blocks = self.native.num_blocks

    def mask_refusal(self) -> str | None:
        """Why this model cannot take a step mask at this schedule (its scheduler's step count), or None."""
        refusal = getattr(self.native, "mask_refusal", None)
        return None if refusal is None else refusal(self.steps)

    def fitted_refusal(self) -> str | None:
        """Why the fitted output predictor cannot be fitted on this model at this schedule, or None (Krea-2 takes
        it; a family's pipeline: `FamilyRunner.fitted_refusal`)."""
        refusal = getattr(self.native, "fitted_refusal", None)
        return None if refusal is None else refusal(self.schedule)

    def run(self, prompt: str, seed: int, config: CacheConfig | None) -> Measurement:
        s = self.native.generate(prompt, seed, self.schedule, self.steps, self.height, self.width, config)
        return Measurement(s.image, s.blocks_run, s.calls * s.num_blocks, s.total_s)
