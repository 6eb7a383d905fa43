"""The search: references, candidates run hardest-sample-first with an exact early stop, and the choice (see the
package docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..engine.policies import step_mask
from ..errors import ConfigError
from ..settings.cache_config import CacheConfig
from ..sweep.metrics import PSNR_CAP_DB, psnr
from ..sweep.progress import progress_bar
from ..sweep.settings import label
from .candidates import CANDIDATES, check_candidate
from .errors import CalibrationError
from .masks import MAX_MASK_STEPS, Mask, beam_search, computed_steps, mask_overrides, max_scored
from .predictor import PredictorSearch, climb_masks, predictor_overrides, search_below_target
from .runner import Runner

Criterion = Literal["min", "mean"]
CRITERIA: tuple[str, ...] = ("min", "mean")


@dataclass
class CandidateResult:
    """One candidate's outcome. `status`: ``complete`` (ran on every sample), ``stopped`` (early stop: cannot meet
    the target), ``invalid`` (rejected before running; `error` says why). `psnr` / `blocks_run` / `blocks_total` are
    keyed by sample index."""

    index: int
    overrides: Any
    status: str = "pending"
    error: str | None = None
    config: CacheConfig | None = None
    psnr: dict[int, float] = field(default_factory=dict)
    blocks_run: dict[int, float] = field(default_factory=dict)
    blocks_total: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    meets_target: bool = False
    sample_configs: dict[int, CacheConfig] = field(default_factory=dict)
    """Per sample index, the config it runs with instead of `config` (a fitted predictor's held-out fits)."""
    fitted_mask: tuple[int, ...] | None = None
    """The step mask of a fitted-predictor candidate (`Calibration.finalize` fits its final file)."""

    @property
    def label(self) -> str:
        return label(self.overrides) if isinstance(self.overrides, Mapping) else repr(self.overrides)

    @property
    def psnr_min(self) -> float | None:
        return min(self.psnr.values()) if self.psnr else None

    @property
    def psnr_mean(self) -> float | None:
        return sum(self.psnr.values()) / len(self.psnr) if self.psnr else None

    @property
    def compute_fraction(self) -> float | None:
        total = sum(self.blocks_total.values())
        return sum(self.blocks_run.values()) / total if total else None

    def score(self, criterion: Criterion) -> float | None:
        return self.psnr_min if criterion == "min" else self.psnr_mean

    def to_dict(self, samples: Sequence[tuple[str, int]]) -> dict[str, Any]:
        def rounded(value: float | None, digits: int) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "index": self.index,
            "label": self.label,
            "overrides": self.overrides,
            "status": self.status,
            "error": self.error,
            "meets_target": self.meets_target,
            "samples_run": len(self.psnr),
            "compute_fraction": rounded(self.compute_fraction, 6),
            "psnr_min_db": rounded(self.psnr_min, 4),
            "psnr_mean_db": rounded(self.psnr_mean, 4),
            "per_sample": [
                {
                    "prompt": samples[i][0],
                    "seed": samples[i][1],
                    "psnr_db": round(self.psnr[i], 4),
                    "blocks_run": self.blocks_run[i],
                    "blocks_total": self.blocks_total[i],
                }
                for i in sorted(self.psnr)
            ],
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Calibration:
    """Everything `calibrate` measured: the samples, the references' block counts and time, every candidate."""

    samples: list[tuple[str, int]]
    target_psnr: float
    criterion: Criterion
    reference_blocks: list[int]
    reference_seconds: float
    candidates: list[CandidateResult]
    chosen: CandidateResult | None
    predictor: PredictorSearch | None = None

    def finalize(self, candidate: CandidateResult) -> CandidateResult:
        """A fitted-predictor candidate made ready to use: its predictor fitted on every calibration prompt (it was
        scored with fits made without each sample's prompt), its settings naming that file. Others: unchanged."""
        if candidate.fitted_mask is None or self.predictor is None:
            return candidate
        path = self.predictor.fit(candidate.fitted_mask)
        candidate.overrides = predictor_overrides(candidate.fitted_mask, str(path))
        candidate.config = candidate.config.merged({"fitted_predictor": str(path)})
        return candidate

    def best(self) -> CandidateResult | None:
        """The candidate with the highest criterion PSNR over the samples it ran (complete ones first)."""
        ran = [c for c in self.candidates if c.psnr]
        if not ran:
            return None
        return max(ran, key=lambda c: (c.status == "complete", c.score(self.criterion), -c.index))

    def failure_message(self) -> str:
        what = f"{'worst-case (min)' if self.criterion == 'min' else 'mean'} PSNR >= {self.target_psnr:g} dB"
        head = f"no candidate meets the target {what} vs uncached over {len(self.samples)} prompt(s)"
        best = self.best()
        if best is None:
            return f"{head}: no candidate could run (all invalid); nothing written"
        partial = "" if best.status == "complete" else f", over the {len(best.psnr)} prompt(s) it ran before stopping"
        return (
            f"{head}; the best PSNR achieved is {best.score(self.criterion):.2f} dB ({self.criterion}) by candidate "
            f"#{best.index} {best.label} at compute {best.compute_fraction:.3f}{partial}; nothing written. "
            "Lower --target-psnr or add more conservative --candidates"
        )


def _cannot_qualify(values: Sequence[float], total: int, target: float, criterion: Criterion) -> bool:
    """True when the PSNRs so far rule the candidate out whatever the remaining samples give."""
    if criterion == "min":
        return min(values) < target
    return sum(values) + (total - len(values)) * PSNR_CAP_DB < target * total


def calibrate(
    runner: Runner,
    samples: Sequence[tuple[str, int]],
    candidates: Iterable[Any] = CANDIDATES,
    *,
    target_psnr: float = 35.0,
    criterion: Criterion = "min",
    early_stop: bool = True,
    progress: bool = True,
    on_reject: Callable[[CandidateResult], None] | None = None,
    base: CacheConfig | None = None,
    step_masks: bool = False,
    predictor: PredictorSearch | None = None,
    reference: Runner | None = None,
) -> Calibration:
    """Run the references and the candidates on `samples` and choose (see the module docstring).

    `step_masks`: on schedules of at most `MAX_MASK_STEPS` steps, first search per-step masks (`masks.beam_search`,
    every sample, no early stop); each mask scored becomes a candidate after the listed ones.
    `predictor`: also search masks whose cached steps the fitted output predictor answers (`cached_step_method=
    fitted`), each fitted by `predictor.fit` on its own samples (training prompts, never `samples`' seeds): on short
    schedules its `starts`, then the beam search, then `search_below_target`; on longer ones `predictor.first_masks`
    (the curved masks of its budgets, or its `starts`), then `climb_masks` (either climb at most `predictor.climb`
    more fits); each becomes a candidate.

    `reference`: the runner the uncached references come from (default `runner`): the unquantized model when
    `runner` runs the quantized one that will be served, so that the PSNR counts both errors.

    `on_reject` is called for each invalid candidate (the command prints them as they are found); `base`: the config
    every candidate is merged over (default the built-in defaults; `fit_algorithms`' values go there)."""
    if criterion not in CRITERIA:
        raise CalibrationError(f"criterion={criterion!r} is invalid: must be one of {', '.join(CRITERIA)}")
    if not math.isfinite(target_psnr) or target_psnr <= 0:
        raise CalibrationError(f"--target-psnr={target_psnr!r} is invalid: must be a number of dB > 0")
    samples = [(str(p), int(s)) for p, s in samples]
    if not samples:
        raise CalibrationError("calibration needs at least one prompt")
    results = []
    refusal = runner.mask_refusal() if hasattr(runner, "mask_refusal") else None  # e.g. a scheduler of order 2
    for index, overrides in enumerate(candidates):
        result = CandidateResult(index, overrides)
        try:
            result.config = check_candidate(overrides, runner.num_blocks, runner.steps, base)
            if refusal is not None and step_mask(result.config, runner.steps) is not None:
                raise ConfigError(refusal)
        except (ConfigError, TypeError, ValueError) as exc:
            result.status, result.error = "invalid", str(exc)
            if on_reject is not None:
                on_reject(result)
        results.append(result)
    valid = [r for r in results if r.status != "invalid"]
    n = len(samples)
    searching = step_masks and runner.steps <= MAX_MASK_STEPS and refusal is None
    planned_masks = max_scored(runner.steps) if searching else 0  # an upper bound: the total never grows
    long_masks = []
    planned_predicted = 0
    if predictor is not None and refusal is None:
        if runner.steps <= MAX_MASK_STEPS:
            planned_predicted = max_scored(runner.steps) + len(predictor.starts) + predictor.climb
        else:
            long_masks = predictor.first_masks(runner.steps)
            planned_predicted = len(long_masks) + predictor.climb
    with progress_bar(
        total=n * (1 + len(valid) + planned_masks + planned_predicted),
        desc="calibrate",
        unit="image",
        disable=not progress,
        leave=False,
    ) as bar:
        references, reference_blocks, reference_seconds = [], [], 0.0
        for prompt, seed in samples:
            bar.set_postfix_str("uncached reference")
            try:
                ref = (reference or runner).run(prompt, seed, None)
            except ValueError as exc:  # e.g. a size off the model's multiple: nothing can run
                raise CalibrationError(f"the uncached reference of {prompt!r} failed: {exc}") from None
            references.append(ref.image)
            reference_blocks.append(ref.blocks_total)
            reference_seconds += ref.seconds
            bar.update()
        hardest: dict[int, float] = {}  # sample index -> lowest PSNR any candidate got on it

        def measure(result: CandidateResult, i: int) -> float | None:
            """Run `result` on sample `i` and record it; None (and the candidate invalid) when the pipeline
            refuses the setting (ConfigError is a ValueError: not fatal)."""
            prompt, seed = samples[i]
            try:
                run = runner.run(prompt, seed, result.sample_configs.get(i, result.config))
            except ValueError as exc:
                result.status, result.error = "invalid", str(exc)
                if on_reject is not None:
                    on_reject(result)
                return None
            value = psnr(run.image, references[i])[0]
            result.psnr[i], result.blocks_run[i] = value, run.blocks_run
            result.blocks_total[i] = reference_blocks[i]  # compute is measured against the uncached run
            result.seconds += run.seconds
            hardest[i] = min(hardest.get(i, math.inf), value)
            bar.update()
            return value

        def finish(result: CandidateResult) -> None:
            if result.status == "pending":
                result.status = "complete"
                result.meets_target = result.score(criterion) >= target_psnr
            bar.total -= n - len(result.psnr)  # the generations an early stop saved
            bar.refresh()

        def score_overrides(
            overrides: dict[str, Any],
            what: str,
            per_sample: dict[int, dict[str, Any]] | None = None,
            fitted_mask: Mask | None = None,
        ) -> float | None:
            result = CandidateResult(len(results), overrides)
            result.config = check_candidate(result.overrides, runner.num_blocks, runner.steps)
            for i, sample_overrides in (per_sample or {}).items():
                result.sample_configs[i] = check_candidate(sample_overrides, runner.num_blocks, runner.steps)
            result.fitted_mask = None if fitted_mask is None else tuple(fitted_mask)
            results.append(result)
            bar.set_postfix_str(what)
            for i in range(n):
                if measure(result, i) is None:
                    break
            finish(result)
            return result.score(criterion) if result.status == "complete" else None

        if searching:
            scored = beam_search(
                runner.steps,
                lambda mask: score_overrides(mask_overrides(mask), f"mask {computed_steps(mask)}"),
                target=target_psnr,
            )
            bar.total -= n * (planned_masks - len(scored))  # the masks the search did not reach
            bar.refresh()
        if predictor is not None and refusal is None:

            def score_predicted(mask: Mask) -> float | None:
                bar.set_postfix_str(f"fitting {computed_steps(mask)}")
                held_out = predictor.held_out_paths(mask)  # each sample scored by a fit without its prompt
                per_sample = {i: predictor_overrides(mask, str(path)) for i, path in held_out.items()}
                return score_overrides(per_sample[0], f"fitted {computed_steps(mask)}", per_sample, mask)

            if runner.steps <= MAX_MASK_STEPS:  # `starts` (--fit-masks) first, then the search, each mask once
                known = {mask: score_predicted(mask) for mask in predictor.starts}
                scored = beam_search(
                    runner.steps, lambda m: known[m] if m in known else score_predicted(m), target=target_psnr
                )
                known.update(scored)
                below = search_below_target(known, score_predicted, target=target_psnr, budget=predictor.climb)
                bar.total -= n * (planned_predicted - len(known.keys() | {m for m, _ in below}))
                bar.refresh()
            else:
                curved = {mask: score_predicted(mask) for mask in long_masks}
                climbed = climb_masks(curved, score_predicted, target=target_psnr, budget=predictor.climb)
                bar.total -= n * (predictor.climb - len(climbed))
                bar.refresh()
        for result in valid:
            order = sorted(range(n), key=lambda i: (hardest.get(i, math.inf), i)) if early_stop else range(n)
            bar.set_postfix_str(f"#{result.index} {result.label}"[:60])
            for i in order:
                value = measure(result, i)
                if value is None:
                    break
                done = list(result.psnr.values())
                if early_stop and len(done) < n and _cannot_qualify(done, n, target_psnr, criterion):
                    result.status = "stopped"
                    result.error = (
                        f"stopped after {len(done)} of {n} prompts: PSNR {value:.2f} dB on {samples[i][0]!r} "
                        f"rules out {criterion} >= {target_psnr:g} dB"
                    )
                    break
            finish(result)
    qualified = [r for r in results if r.meets_target]
    chosen = min(qualified, key=lambda r: (r.compute_fraction, -r.score(criterion), r.index)) if qualified else None
    calibration = Calibration(
        samples, target_psnr, criterion, reference_blocks, reference_seconds, results, chosen, predictor
    )
    if chosen is not None:
        calibration.finalize(chosen)
    return calibration
