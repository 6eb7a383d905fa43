"""The fitted output predictor in `dicache calibrate`: step masks whose cached steps it answers, each fitted on the
calibration prompts with other seeds (`sweep.fitting`) and scored on prompts its fit did not see, written next to
the profile.

`predictor_overrides(mask, path)` is the candidate; `PredictorSearch` fits and writes them; the masks tried are
the beam search's on short schedules (`masks.beam_search`, as the whole-step masks, then `search_below_target`:
the sizes below the cheapest one meeting the target, whole when affordable) and, on longer ones,
`long_schedule_masks` (curved masks) and then `climb_masks` (a hill-climb from the best of them, cheapest budget
first, until one meets the target), each scored on held-out folds like every predictor candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..engine.cached_step import DEFAULT_RIDGE
from ..engine.policies import curved_mask
from ..sweep.fitting import BatchRun, Trajectory, fit_predictor, fit_samples
from ..sweep.settings import RECOMMENDED_BUDGETS
from .errors import CalibrationError
from .masks import Mask, hill_climb, mask_bins, masks_of

CLIMB_FITS = 24
"""Masks `climb_masks` (long schedules) or `search_below_target` (short ones) may score by default (`dicache calibrate
--mask-climb`)."""


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
    """The fits of a calibration, scored on prompts they did not see.

    The calibration prompts are split in two folds (even and odd position among the distinct prompts; with
    `leave_prompt_out`, one fold per prompt).
    `held_out_paths(mask)` fits the predictor of `mask` twice, each time on one fold's prompts with the other seeds
    (`fit_samples`: `seed + 1 … seed + k`), and gives each calibration sample the fit made without its prompt: a
    candidate's PSNR then says what the predictor does on a new prompt, not on the prompts it was fitted on (on the
    Turbo student, a mask fitted on the captions it was scored on met 35 dB there and gave 28 dB on held-out
    prompts). `fit(mask)` fits on every prompt: the file a chosen candidate's profile names
    (`Calibration.finalize`). Files go to `folder/mask-<flags>[-without-<fold>].safetensors`; the uncached batch of
    the fit samples is recorded once;
    `fits` counts the masks fitted."""

    def __init__(
        self,
        runner: Any,
        samples: Sequence[tuple[str, int]],
        fit_seeds: int,
        folder: str | Path,
        ridge: float = DEFAULT_RIDGE,
        reference: Any = None,
        leave_prompt_out: bool = False,
        budgets: Sequence[float] = RECOMMENDED_BUDGETS,
        climb: int = CLIMB_FITS,
        starts: Sequence[Mask] = (),
    ) -> None:
        """`runner`: a `PipelineRunner` (its native runner, schedule and size make the batch run); `samples`: the
        calibration samples (at least 2 prompts); `fit_seeds`: seeds per prompt fitted on; `reference`: the runner
        whose uncached run the fit steers to (default `runner`; the unquantized model when `runner` is the
        quantized one that will be served); `leave_prompt_out`: one fold per prompt (each scored by a fit on all
        the others) instead of two. `starts` (`--fit-masks`): masks scored first, before the beam search on short
        schedules, instead of the curved masks on long ones. On long schedules: `budgets`, the compute fractions
        whose curved masks are tried (unless `starts` are given). `climb`: the most masks scored after them (long
        schedules: `climb_masks`) or after the beam search (short ones: `search_below_target`); 0: none."""
        shortage = prompt_shortage(samples)
        if shortage is not None:
            raise CalibrationError(shortage)
        prompts = list(dict.fromkeys(prompt for prompt, _ in samples))
        if fit_seeds < 1:
            raise CalibrationError(f"fit_seeds={fit_seeds} is invalid: must be >= 1")
        self.run = BatchRun(runner.native, runner.schedule, runner.height, runner.width)
        reference = reference or runner
        self.reference = BatchRun(reference.native, reference.schedule, reference.height, reference.width)
        self.samples, self.fit_seeds, self.folder, self.ridge = list(samples), fit_seeds, Path(folder), ridge
        self.budgets, self.climb, self.starts = tuple(budgets), climb, [tuple(m) for m in starts]
        self.fit_rows = fit_samples(self.samples, fit_seeds)  # sample i's rows: i·fit_seeds … (i + 1)·fit_seeds − 1
        folds = len(prompts) if leave_prompt_out else 2
        self._folds = [prompts.index(prompt) % folds for prompt, _ in self.samples]  # a prompt's seeds share a fold
        self.trajectory: Trajectory | None = None
        self._paths: dict[tuple[Mask, int | None], Path] = {}
        self.fits = 0

    def first_masks(self, num_steps: int) -> list[Mask]:
        """The masks a schedule too long for the beam search tries before the climb: `starts` when given, else the
        curved masks of `budgets` (`long_schedule_masks`)."""
        return list(self.starts) or long_schedule_masks(num_steps, self.budgets)

    def fold(self, index: int) -> int:
        """The fold of calibration sample `index`: its prompt's position among the distinct prompts (modulo 2 unless
        each prompt is its own fold)."""
        return self._folds[index]

    def fit(self, mask: Mask, without: int | None = None) -> Path:
        """The predictor of `mask` fitted on every calibration prompt (`without` None) or on those outside fold
        `without`; written once, its path returned."""
        key = (tuple(mask), without)
        if key in self._paths:
            return self._paths[key]
        if self.trajectory is None:
            self.trajectory = Trajectory.record(self.reference, self.fit_rows)
        if not any(k[0] == tuple(mask) for k in self._paths):
            self.fits += 1
        keep = [i for i in range(len(self.samples)) if without is None or self.fold(i) != without]
        rows = [i * self.fit_seeds + k for i in keep for k in range(self.fit_seeds)]
        samples = [self.fit_rows[r] for r in rows]
        trajectory = self.trajectory.subset(rows)
        weights = fit_predictor(self.run, samples, predictor_overrides(mask), trajectory, self.ridge)
        name = "".join(map(str, mask)) + ("" if without is None else f"-without-{without}")
        self._paths[key] = weights.save(self.folder / f"mask-{name}.safetensors")
        return self._paths[key]

    def held_out_paths(self, mask: Mask) -> dict[int, Path]:
        """Per calibration sample index, the predictor of `mask` fitted without its fold's prompts."""
        return {i: self.fit(mask, without=self.fold(i)) for i in range(len(self.samples))}


def search_below_target(
    scored: Mapping[Mask, float | None],
    score: Callable[[Mask], float | None],
    *,
    target: float,
    budget: int,
) -> list[tuple[Mask, float | None]]:
    """After the beam search of a short schedule (`scored`: mask -> criterion PSNR, None where it could not run),
    which keeps a few masks per computed-step count and so can pass by a cheaper mask meeting `target`: per count,
    from the one below the cheapest count meeting `target` (the costliest count scored when none does) downwards,
    every mask of that count not scored yet when they fit in what is left of `budget` (nearest to the count's best
    mask first), else a `masks.hill_climb` from that best mask. Stops at a count that does not meet `target` (a
    cheaper one would not either) or when `budget` scores are spent. Returns the masks scored here, in order."""
    known = dict(scored)
    valid = {m: v for m, v in known.items() if v is not None}
    if not valid:
        return []
    num_steps = len(next(iter(valid)))
    meeting = [sum(m) for m, v in valid.items() if v >= target]
    top = min(meeting) - 1 if meeting else max(sum(m) for m in valid)
    found: list[tuple[Mask, float | None]] = []
    for count in sorted({sum(m) for m in valid if sum(m) <= top}, reverse=True):
        left = budget - len(found)
        if left < 1:
            break
        start = max((m for m in valid if sum(m) == count), key=lambda m: (valid[m], m))
        unscored = [m for m in masks_of(num_steps, count) if m not in known]
        if len(unscored) <= left:
            unscored.sort(key=lambda m: (sum(a != b for a, b in zip(m, start)), m))
            searched = [(m, score(m)) for m in unscored]
        else:
            searched = hill_climb(start, score, known=known, budget=left)
        known.update(searched)
        found += searched
        if max([valid[start], *(v for _, v in searched if v is not None)]) < target:
            break
    return found


def prompt_shortage(samples: Sequence[tuple[str, int]]) -> str | None:
    """Why the fitted predictor cannot be searched on `samples` (fewer than 2 distinct prompts: each prompt is scored
    with a fit made on the others), or None."""
    count = len({prompt for prompt, _ in samples})
    if count >= 2:
        return None
    return (
        f"the fitted predictor needs at least 2 calibration prompts (got {count}): each is scored with a fit made on "
        "the others"
    )


def parse_mask(text: str, num_steps: int, flag: str = "--fit-masks") -> Mask:
    """The mask computing the steps `text` lists (comma-separated indices, e.g. `0,1,2,3,5,9,16,25`) of a
    `num_steps` schedule; CalibrationError naming `flag` when it does not list step 0 or lists a step outside it."""
    try:
        steps = {int(part) for part in text.split(",")}
    except ValueError:
        steps = set()
    if 0 not in steps or not all(0 <= s < num_steps for s in steps):
        raise CalibrationError(
            f"{flag}={text!r} is invalid: comma-separated computed steps in 0 … {num_steps - 1}, step 0 among them "
            "(e.g. 0,1,2,3,5,9,16,25)"
        )
    return tuple(1 if i in steps else 0 for i in range(num_steps))


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
