"""The fitted output predictor in `dicache calibrate`: step masks whose cached steps it answers, each fitted on the
calibration prompts with other seeds (`sweep.fitting`), written next to the profile.

`predictor_overrides(mask, path)` is the candidate; `PredictorSearch.fit(mask)` fits and writes one; the masks tried
are the beam search's on short schedules (`masks.beam_search`, as the whole-step masks) and `long_schedule_masks` on
longer ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engine.cached_step import DEFAULT_RIDGE
from ..engine.policies import curved_mask
from ..sweep.fitting import BatchRun, Trajectory, fit_predictor
from ..sweep.settings import RECOMMENDED_BUDGETS
from .masks import Mask, mask_bins


def predictor_overrides(mask: Sequence[int], path: str | None = None) -> dict[str, Any]:
    """The candidate computing the steps `mask` flags and predicting the others with the fitted predictor at `path`
    (None while fitting)."""
    compute, cache = mask_bins(mask)
    overrides: dict[str, Any] = {
        "scm_compute_bins": compute,
        "scm_cache_bins": cache,
        "scm_policy": "static",
        "max_warmup_steps": 0,
        "Fn_compute_blocks": 0,
        "cached_step_method": "fitted",
    }
    if path is not None:
        overrides["fitted_predictor"] = str(path)
    return overrides


class PredictorSearch:
    """The fits of a calibration: `fit(mask)` fits the predictor of `mask` on the fit samples (their uncached batch
    recorded once, on first use) and writes it to `folder/mask-<flags>.safetensors`; `fits` counts them.

    `leave_prompt_out`: each calibration prompt is scored with a predictor fitted without that prompt's samples
    (`fit_without`: one more fit per prompt and mask), so a fitted candidate is measured, as a sweep then judges it,
    on prompts it was not fitted on; the whole-step forecasts it competes with were never fitted on any."""

    def __init__(
        self,
        runner: Any,
        samples: Sequence[tuple[str, int]],
        folder: str | Path,
        ridge: float = DEFAULT_RIDGE,
        reference: Any = None,
        leave_prompt_out: bool = False,
    ) -> None:
        """`runner`: a `PipelineRunner` (its native runner, schedule and size make the batch run); `reference`: the
        one whose uncached run the fit steers to (default `runner`; the unquantized model when `runner` is the
        quantized one that will be served)."""
        self.run = BatchRun(runner.native, runner.schedule, runner.height, runner.width)
        reference = reference or runner
        self.reference = BatchRun(reference.native, reference.schedule, reference.height, reference.width)
        self.samples, self.folder, self.ridge = list(samples), Path(folder), ridge
        self.leave_prompt_out = leave_prompt_out
        self.trajectory: Trajectory | None = None
        self.fits = 0

    def _trajectory(self) -> Trajectory:
        if self.trajectory is None:
            self.trajectory = Trajectory.record(self.reference, self.samples)
        return self.trajectory

    def fit(self, mask: Mask) -> Path:
        weights = fit_predictor(self.run, self.samples, predictor_overrides(mask), self._trajectory(), self.ridge)
        self.fits += 1
        return weights.save(self.folder / f"mask-{''.join(map(str, mask))}.safetensors")

    def fit_without(self, mask: Mask, prompts: Sequence[str]) -> dict[str, Path]:
        """Per prompt of `prompts`, the predictor of `mask` fitted on the other prompts' fit samples (written to
        `folder/mask-<flags>-without-<k>.safetensors`); a prompt with no other prompt's samples to fit on gets
        none."""
        trajectory, found = self._trajectory(), {}
        for k, prompt in enumerate(dict.fromkeys(prompts)):
            rows = [i for i, (p, _) in enumerate(self.samples) if p != prompt]
            if not rows:
                continue
            kept = Trajectory({step: x[rows] for step, x in trajectory.x.items()}, trajectory.dt)
            subset = [self.samples[i] for i in rows]
            weights = fit_predictor(self.run, subset, predictor_overrides(mask), kept, self.ridge)
            self.fits += 1
            found[prompt] = weights.save(self.folder / f"mask-{''.join(map(str, mask))}-without-{k}.safetensors")
        return found


def long_schedule_masks(num_steps: int) -> list[Mask]:
    """The masks a schedule too long for the beam search (`masks.MAX_MASK_STEPS`) tries with the predictor: the
    curved masks of `RECOMMENDED_BUDGETS` at curves 1.5, 2.0, 2.5 and 3.0, each once."""
    found: dict[Mask, None] = {}
    for fraction in RECOMMENDED_BUDGETS:
        for curve in (1.5, 2.0, 2.5, 3.0):
            found[tuple(curved_mask(num_steps, fraction, curve))] = None
    return [m for m in found if 0 in m]
