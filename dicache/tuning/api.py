"""`dicache.calibrate(pipe, prompts, target_psnr=…)`: `dicache calibrate` from Python, on a pipeline a user built
(our Krea-2 or a registered family's diffusers pipeline). Returns a `Profile` that `dicache.enable(pipe, profile)`
takes and `profile.save(path)` writes as a settings profile."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import torch

from .. import __version__
from ..api import disable
from ..models.krea2.pipeline import Krea2Pipeline
from ..models.krea2.presets import PRESETS, resolve_variant
from ..settings.cache_config import CacheConfig
from ..settings.profiles import Profile
from ..sweep.runners import FamilyRunner, runner_for
from .candidates import CANDIDATES
from .errors import CalibrationError, TargetNotMet
from .fits import fit_algorithms
from .report import calibration_record, profile_settings
from .runner import PipelineRunner
from .search import Criterion
from .search import calibrate as search


def calibrate(
    pipe: Any,
    prompts: Iterable[str | tuple[str, int]],
    *,
    target_psnr: float = 35.0,
    steps: int | None = None,
    guidance: float | None = None,
    embedded_guidance: float | None = None,
    height: int | None = None,
    width: int | None = None,
    criterion: Criterion = "min",
    candidates: Sequence[Any] | None = None,
    step_masks: bool = True,
    progress: bool = False,
    call: Mapping[str, Any] | None = None,
) -> Profile:
    """The least-compute cache settings whose PSNR against the uncached image meets `target_psnr` on `prompts`
    (strings, seed 0, 1, …; or (prompt, seed) pairs), at the schedule you will sample with: `steps` / `guidance`
    (the standard CFG scale; 1 = off) default to Krea-2's preset, or for a family's pipeline to its call's default
    steps and no CFG; `call`: extra keyword arguments of its every call (e.g. `max_sequence_length`). The procedure
    is `dicache calibrate`'s (`dicache.tuning`); the pipeline is left uncached.
    `TargetNotMet` when no candidate meets the target; a setting the model cannot take is refused before any run."""
    samples = [(p, i) if isinstance(p, str) else (str(p[0]), int(p[1])) for i, p in enumerate(prompts)]
    if not samples:
        raise CalibrationError("dicache.calibrate needs at least one prompt")
    runner = runner_for(pipe, call)
    variant = None
    if isinstance(runner, FamilyRunner):
        default_steps, default_guidance = runner.model.sampling["steps"], runner.model.sampling["guidance"]
    else:
        variant = resolve_variant(pipe, None)
        default_steps, default_guidance = PRESETS[variant].num_inference_steps, PRESETS[variant].guidance_scale
    steps = steps or default_steps
    guidance = float(default_guidance if guidance is None else guidance)
    default_height, default_width = runner.default_size
    height, width = height or default_height, width or default_width
    measured = PipelineRunner(runner, steps, guidance, variant, height, width, embedded_guidance=embedded_guidance)
    try:
        fits = fit_algorithms(measured, *samples[0])
        result = search(
            measured,
            samples,
            list(candidates) if candidates is not None else list(CANDIDATES),
            target_psnr=target_psnr,
            criterion=criterion,
            progress=progress,
            step_masks=step_masks,
            base=CacheConfig.defaults().merged(fits),
        )
    finally:
        disable(pipe)
    if result.chosen is None:
        raise TargetNotMet(result.failure_message())
    parameter = next(pipe.transformer.parameters())
    record = calibration_record(
        result,
        model=None,
        model_source=type(pipe).__name__ if not isinstance(pipe, Krea2Pipeline) else pipe.source,
        num_blocks=measured.num_blocks,
        variant=variant,
        steps=steps,
        guidance_scale=guidance,
        embedded_guidance=embedded_guidance,
        width=width,
        height=height,
        device=str(parameter.device),
        dtype=str(parameter.dtype).removeprefix("torch."),
        measured_on=getattr(runner, "measured_on", None) or "image",
        fitted_on={"prompt": samples[0][0], "seed": samples[0][1]},
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        dicache_version=__version__,
        torch_version=torch.__version__,
    )
    return Profile(profile_settings(result.chosen), record)
