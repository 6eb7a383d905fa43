"""The fitted output predictor in `dicache calibrate`: step masks whose cached steps it answers, each fitted on the
calibration prompts with other seeds (`sweep.fitting`), written next to the profile.

`predictor_overrides(mask, path)` is the candidate; `PredictorSearch.fit(mask)` fits and writes one; the masks tried
are the beam search's on short schedules (`masks.beam_search`, as the whole-step masks) and, on longer ones,
`long_schedule_masks` (curved masks) and then `climb_masks` (a hill-climb from the best of them, cheapest budget
first, until one meets the target).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..engine.cached_step import DEFAULT_RIDGE
from ..engine.policies import curved_mask
from ..sweep.fitting import BatchRun, Trajectory, fit_predictor
from ..sweep.settings import RECOMMENDED_BUDGETS
from .masks import Mask, hill_climb, mask_bins

CLIMB_FITS = 24
"""Fits `climb_masks` may spend by default (`dicache calibrate --mask-climb`)."""


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
    recorded once, on first use) and writes it to `folder/mask-<flags>.safetensors`; `fits` counts them."""

    def __init__(
        self,
        runner: Any,
        samples: Sequence[tuple[str, int]],
        folder: str | Path,
        ridge: float = DEFAULT_RIDGE,
        reference: Any = None,
        budgets: Sequence[float] = RECOMMENDED_BUDGETS,
        climb: int = CLIMB_FITS,
    ) -> None:
        """`runner`: a `PipelineRunner` (its native runner, schedule and size make the batch run); `reference`: the
        one whose uncached run the fit steers to (default `runner`; the unquantized model when `runner` is the
        quantized one that will be served). On long schedules: `budgets`, the compute fractions whose curved masks
        are tried; `climb`, the fits the hill-climb from them may spend (0: none)."""
        self.run = BatchRun(runner.native, runner.schedule, runner.height, runner.width)
        reference = reference or runner
        self.reference = BatchRun(reference.native, reference.schedule, reference.height, reference.width)
        self.samples, self.folder, self.ridge = list(samples), Path(folder), ridge
        self.budgets, self.climb = tuple(budgets), climb
        self.trajectory: Trajectory | None = None
        self.fits = 0

    def fit(self, mask: Mask) -> Path:
        if self.trajectory is None:
            self.trajectory = Trajectory.record(self.reference, self.samples)
        weights = fit_predictor(self.run, self.samples, predictor_overrides(mask), self.trajectory, self.ridge)
        self.fits += 1
        return weights.save(self.folder / f"mask-{''.join(map(str, mask))}.safetensors")


def long_schedule_masks(num_steps: int, budgets: Sequence[float] = RECOMMENDED_BUDGETS) -> list[Mask]:
    """The masks a schedule too long for the beam search (`masks.MAX_MASK_STEPS`) tries with the predictor first: the
    curved masks of `budgets` at curves 1.5, 2.0, 2.5 and 3.0, each once."""
    found: dict[Mask, None] = {}
    for fraction in budgets:
        for curve in (1.5, 2.0, 2.5, 3.0):
            found[tuple(curved_mask(num_steps, fraction, curve))] = None
    return [m for m in found if 0 in m]


def climb_masks(
    scored: Mapping[Mask, float | None],
    score: Callable[[Mask], float | None],
    *,
    target: float,
    budget: int,
) -> list[tuple[Mask, float | None]]:
    """After the curved masks (`scored`: mask -> criterion PSNR, None where it could not run): per computed-step
    count, cheapest first, a `masks.hill_climb` from that count's best mask, until a count has a mask meeting `target`
    (a costlier one would not be chosen) or `budget` scores are spent. Returns the masks scored here, in order."""
    found: list[tuple[Mask, float | None]] = []
    known = dict(scored)
    counts = sorted({sum(m) for m, v in scored.items() if v is not None})
    for count in counts:
        if len(found) >= budget:
            break
        start = max((m for m, v in scored.items() if v is not None and sum(m) == count), key=lambda m: scored[m])
        climbed = hill_climb(start, score, known=known, budget=budget - len(found))
        known.update(climbed)
        found += climbed
        if max([scored[start], *(v for _, v in climbed if v is not None)]) >= target:
            break
    return found
