"""Calibration: the cheapest cache settings that keep a fidelity target, measured on a model (`dicache calibrate`).

Procedure (`calibrate`):

1. Each sample (prompt, seed) is generated once uncached: the reference image and the reference block count
   (transformer calls x blocks, all CFG branches).
2. Each candidate (a dict of per-request override keys, merged over the built-in defaults; the environment is
   ignored so that a calibration is reproducible) is checked against the model and schedule first: an unknown key,
   a bad value, an impossible Fn/Bn split or a step mask the step count cannot hold makes it *invalid*; it is
   reported and skipped.
3. A valid candidate runs on the samples. Per sample: PSNR of the decoded image against the reference
   (`dicache.sweep.metrics.psnr`) and the blocks dicache's statistics say were run (`RequestStats.blocks_run`, all
   branches). Its compute fraction is the sum of its blocks over the sum of the references' blocks.
4. Early stop (exact, never changes the choice): a candidate stops as soon as it can no longer qualify; under the
   `min` criterion that is the first sample below the target, under `mean` when even `PSNR_CAP_DB` on every
   remaining sample could not lift the mean to the target. Samples run hardest-first (lowest PSNR any earlier
   candidate got on them), so a failing candidate usually costs one generation.
5. The choice: among the candidates that ran on every sample and whose criterion PSNR (`min` over the samples by
   default, the safe reading of a target; or `mean`) is >= the target, the least compute fraction; ties go to the
   higher PSNR, then to the earlier candidate.

`CANDIDATES` is the built-in candidate list; `profile_settings` turns the choice into a profile's `settings`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from .config import SETTINGS, CacheConfig
from .errors import ConfigError, DicacheError
from .sweep.files import read_data_file
from .sweep.metrics import PSNR_CAP_DB, psnr
from .sweep.settings import RECOMMENDED_FAMILY, label

CANDIDATES: tuple[dict[str, Any], ...] = (
    # Whole-step reuse on the curved mask (the recommendation), budget 0.3..0.8:
    # curve 2.5 up to 0.6, 1.5 above, 2.0 at 8 steps.
    *({**RECOMMENDED_FAMILY, "scm_compute_fraction": f, "scm_curve": 2.5} for f in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)),
    *({**RECOMMENDED_FAMILY, "scm_compute_fraction": f, "scm_curve": 2.0} for f in (0.5, 0.6, 0.7)),
    *({**RECOMMENDED_FAMILY, "scm_compute_fraction": f, "scm_curve": 1.5} for f in (0.7, 0.8)),
    # Dynamic DBCache: cache when the first blocks' residual barely moved (SGLang default: RDT 0.24, W 4, MC 3).
    {"residual_diff_threshold": 0.04},
    {"residual_diff_threshold": 0.08},
    {"residual_diff_threshold": 0.12},
    {"residual_diff_threshold": 0.16},
    {"residual_diff_threshold": 0.2},
    {"residual_diff_threshold": 0.24},
    {"residual_diff_threshold": 0.32},
    # ... with TaylorSeer extrapolating the skipped residual instead of reusing it.
    {"residual_diff_threshold": 0.08, "enable_taylorseer": True, "taylorseer_order": 1},
    {"residual_diff_threshold": 0.12, "enable_taylorseer": True, "taylorseer_order": 1},
    {"residual_diff_threshold": 0.24, "enable_taylorseer": True, "taylorseer_order": 1},
    {"residual_diff_threshold": 0.24, "enable_taylorseer": True, "taylorseer_order": 2},
    # ... with a longer warm-up and unlimited runs, or a deeper always-computed prefix.
    {
        "residual_diff_threshold": 0.08,
        "max_warmup_steps": 8,
        "max_continuous_cached_steps": -1,
        "enable_taylorseer": True,
        "taylorseer_order": 1,
    },
    {"residual_diff_threshold": 0.24, "Fn_compute_blocks": 2},
    {
        "residual_diff_threshold": 0.12,
        "Fn_compute_blocks": 4,
        "max_continuous_cached_steps": 4,
        "enable_taylorseer": True,
        "taylorseer_order": 1,
    },
    # Static step computation masks (the mask alone decides: warm-up 0), TaylorSeer off and on.
    {"scm_preset": "slow", "scm_policy": "static", "max_warmup_steps": 0},
    {"scm_preset": "slow", "scm_policy": "static", "max_warmup_steps": 0, "enable_taylorseer": True},
    {"scm_preset": "medium", "scm_policy": "static", "max_warmup_steps": 0},
    {"scm_preset": "medium", "scm_policy": "static", "max_warmup_steps": 0, "enable_taylorseer": True},
    {"scm_preset": "fast", "scm_policy": "static", "max_warmup_steps": 0},
    {"scm_preset": "fast", "scm_policy": "static", "max_warmup_steps": 0, "enable_taylorseer": True},
    {"scm_preset": "ultra", "scm_policy": "static", "max_warmup_steps": 0},
    {"scm_preset": "ultra", "scm_policy": "static", "max_warmup_steps": 0, "enable_taylorseer": True},
)
"""The built-in candidates `dicache calibrate` tries (without `--candidates FILE`): per-request override dicts,
each merged over the built-in defaults. Extend it with any `CacheConfig` request key; order does not matter."""

Criterion = Literal["min", "mean"]
CRITERIA: tuple[str, ...] = ("min", "mean")


class CalibrationError(ConfigError):
    """A bad calibration input (candidate file, prompts, size, target); the message names it."""


class TargetNotMet(DicacheError):
    """No candidate reached the fidelity target; nothing was written."""


# ---------------------------------------------------------------------------------------------------- measuring
@dataclass
class Measurement:
    """One generation: `image` `(3, H, W)` float in [0, 1]; `blocks_run` transformer blocks evaluated over all
    calls and branches; `blocks_total` the calls made x the model's blocks (for an uncached run: what it costs; a
    candidate's compute is measured against its uncached reference's `blocks_total`); `seconds` wall time."""

    image: torch.Tensor
    blocks_run: int
    blocks_total: int
    seconds: float


class Runner(Protocol):
    """Generates one sample at the calibration's fixed schedule and size, uncached (`config` None) or cached."""

    num_blocks: int
    steps: int

    def run(self, prompt: str, seed: int, config: CacheConfig | None) -> Measurement: ...


class PipelineRunner:
    """`Runner` on a pipeline with the native Krea-2 call signature (`dicache.models.krea2.Krea2Pipeline`).

    Uncached runs have dicache disabled (the original forwards) and count the transformer's calls with a forward
    pre-hook: `blocks_run = blocks_total = calls x num_blocks`. Cached runs enable dicache with the candidate's
    config; `blocks_run` is what dicache's statistics say ran (`RequestStats.blocks_run`, all branches)."""

    def __init__(
        self, pipe: Any, steps: int, guidance_scale: float, variant: str | None, height: int, width: int
    ) -> None:
        from . import api

        self.pipe, self.steps, self.guidance_scale, self.variant = pipe, steps, guidance_scale, variant
        self.height, self.width = height, width
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        api.enable(pipe, CacheConfig.defaults())  # the block stack dicache caches, however the model names it
        self.num_blocks = api.session_of(pipe).num_blocks
        api.disable(pipe)

    def run(self, prompt: str, seed: int, config: CacheConfig | None) -> Measurement:
        from . import api

        if config is None:
            api.disable(self.pipe)
        else:
            api.enable(self.pipe, config)  # replaces the previous candidate's settings
        calls = 0

        def count(*_: Any) -> None:
            nonlocal calls
            calls += 1

        handle = self.pipe.transformer.register_forward_pre_hook(count)
        start = time.perf_counter()
        try:
            out = self.pipe(
                prompt,
                height=self.height,
                width=self.width,
                num_inference_steps=self.steps,
                guidance_scale=self.guidance_scale,
                seed=seed,
                output_type="pt",
                variant=self.variant,
            )
        finally:
            handle.remove()
        seconds = time.perf_counter() - start
        blocks_total = calls * self.num_blocks
        blocks_run = blocks_total if config is None else api.stats(self.pipe).blocks_run
        return Measurement(out.images[0].detach().float().cpu(), int(blocks_run), int(blocks_total), seconds)


# ---------------------------------------------------------------------------------------------------- candidates
def load_candidates(path: str | Path) -> list[Any]:
    """The candidate list of a JSON or YAML (.yaml/.yml) file: a list of override dicts, or a mapping whose
    `candidates` is one. Entries are not checked here (a bad entry is reported and skipped by `calibrate`)."""
    data = read_data_file(
        path, "--candidates", CalibrationError, missing=": no such file (expected a JSON/YAML list of dicts)"
    )
    if isinstance(data, Mapping) and "candidates" in data:
        data = data["candidates"]
    if not isinstance(data, list) or not data:
        raise CalibrationError(
            f"--candidates {str(path)!r}: expected a non-empty list of override dicts "
            '(e.g. [{"residual_diff_threshold": 0.12}]), got ' + type(data).__name__
        )
    return data


def check_candidate(overrides: Any, num_blocks: int, steps: int, base: CacheConfig | None = None) -> CacheConfig:
    """The candidate's effective config (caching on, `overrides` over `base`, default the built-in defaults), after
    checking it against a model of `num_blocks` blocks at `steps` steps; `ConfigError` names what is wrong."""
    from .policies import make_policy

    if not isinstance(overrides, Mapping):
        raise ConfigError(f"a candidate must be a dict of override keys, got {overrides!r}")
    config = (base or CacheConfig.defaults()).merged({**dict(overrides), "enable_cache": True})
    config.check_block_split(num_blocks)
    make_policy(config, steps)  # a step mask must fit the step count
    return config


# ---------------------------------------------------------------------------------------------------- results
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
    blocks_run: dict[int, int] = field(default_factory=dict)
    blocks_total: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    meets_target: bool = False

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
) -> Calibration:
    """Run the references and the candidates on `samples` and choose (see the module docstring).

    `on_reject` is called for each invalid candidate (the command prints them as they are found)."""
    from tqdm.auto import tqdm

    if criterion not in CRITERIA:
        raise CalibrationError(f"criterion={criterion!r} is invalid: must be one of {', '.join(CRITERIA)}")
    if not math.isfinite(target_psnr) or target_psnr <= 0:
        raise CalibrationError(f"--target-psnr={target_psnr!r} is invalid: must be a number of dB > 0")
    samples = [(str(p), int(s)) for p, s in samples]
    if not samples:
        raise CalibrationError("calibration needs at least one prompt")
    results = []
    for index, overrides in enumerate(candidates):
        result = CandidateResult(index, overrides)
        try:
            result.config = check_candidate(overrides, runner.num_blocks, runner.steps)
        except (ConfigError, TypeError, ValueError) as exc:
            result.status, result.error = "invalid", str(exc)
            if on_reject is not None:
                on_reject(result)
        results.append(result)
    valid = [r for r in results if r.status != "invalid"]
    n = len(samples)
    bar = tqdm(total=n * (1 + len(valid)), desc="calibrate", unit="image", disable=not progress, leave=False)
    try:
        references, reference_blocks, reference_seconds = [], [], 0.0
        for prompt, seed in samples:
            bar.set_postfix_str("uncached reference")
            try:
                ref = runner.run(prompt, seed, None)
            except ValueError as exc:  # e.g. a size off the model's multiple: nothing can run
                raise CalibrationError(f"the uncached reference of {prompt!r} failed: {exc}") from None
            references.append(ref.image)
            reference_blocks.append(ref.blocks_total)
            reference_seconds += ref.seconds
            bar.update()
        hardest: dict[int, float] = {}  # sample index -> lowest PSNR any candidate got on it
        for result in valid:
            order = sorted(range(n), key=lambda i: (hardest.get(i, math.inf), i)) if early_stop else range(n)
            bar.set_postfix_str(f"#{result.index} {result.label}"[:60])
            for i in order:
                prompt, seed = samples[i]
                try:
                    run = runner.run(prompt, seed, result.config)
                except ValueError as exc:  # a setting the pipeline refuses (ConfigError is one): not fatal
                    result.status, result.error = "invalid", str(exc)
                    if on_reject is not None:
                        on_reject(result)
                    break
                value = psnr(run.image, references[i])[0]
                result.psnr[i], result.blocks_run[i] = value, run.blocks_run
                result.blocks_total[i] = reference_blocks[i]  # compute is measured against the uncached run
                result.seconds += run.seconds
                hardest[i] = min(hardest.get(i, math.inf), value)
                bar.update()
                done = list(result.psnr.values())
                if early_stop and len(done) < n and _cannot_qualify(done, n, target_psnr, criterion):
                    result.status = "stopped"
                    result.error = (
                        f"stopped after {len(done)} of {n} prompts: PSNR {value:.2f} dB on {prompt!r} "
                        f"rules out {criterion} >= {target_psnr:g} dB"
                    )
                    break
            if result.status == "pending":
                result.status = "complete"
                result.meets_target = result.score(criterion) >= target_psnr
            bar.total -= n - len(result.psnr)  # the generations an early stop saved
            bar.refresh()
    finally:
        bar.close()
    qualified = [r for r in results if r.meets_target]
    chosen = min(qualified, key=lambda r: (r.compute_fraction, -r.score(criterion), r.index)) if qualified else None
    return Calibration(samples, target_psnr, criterion, reference_blocks, reference_seconds, results, chosen)


# ---------------------------------------------------------------------------------------------------- output
def profile_settings(result: CandidateResult) -> dict[str, Any]:
    """The profile `settings` of a chosen candidate: caching on and every knob's measured value (None left out),
    so that the profile reproduces the calibrated run even if built-in defaults change."""
    config = result.config
    if config is None:
        raise ValueError("profile_settings needs a candidate that ran")
    settings: dict[str, Any] = {"enable_cache": True}
    for knob in SETTINGS:
        value = getattr(config, knob.key)
        if knob.key != "enable_cache" and value is not None:
            settings[knob.key] = value
    return settings


def format_table(calibration: Calibration) -> str:
    """The candidates by compute fraction (complete, then stopped, then invalid), and the choice."""
    target, criterion = calibration.target_psnr, calibration.criterion
    n = len(calibration.samples)
    header = ("#", "candidate", "compute", "psnr mean", "psnr min", "prompts", f"meets {target:g} dB ({criterion})")

    def key(r: CandidateResult) -> tuple:  # the choice's order: compute, then PSNR, then index
        rank = {"complete": 0, "stopped": 1}.get(r.status, 2)
        compute = r.compute_fraction if r.compute_fraction is not None else math.inf
        score = r.score(criterion)
        return (rank, compute, -score if score is not None else 0.0, r.index)

    rows = [header]
    for r in sorted(calibration.candidates, key=key):
        if r.status == "invalid":
            verdict = f"invalid: {r.error}"
        elif r.status == "stopped":
            verdict = "no (stopped early)"
        else:
            verdict = "yes" if r.meets_target else "no"
        if r is calibration.chosen:
            verdict += "  <- chosen"
        rows.append(
            (
                str(r.index),
                r.label,
                "-" if r.compute_fraction is None else f"{r.compute_fraction:.3f}",
                "-" if r.psnr_mean is None else f"{r.psnr_mean:.2f}",
                "-" if r.psnr_min is None else f"{r.psnr_min:.2f}",
                f"{len(r.psnr)}/{n}",
                verdict,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    chosen = calibration.chosen
    if chosen is not None:
        lines.append(
            f"chosen: #{chosen.index} {chosen.label}: compute {chosen.compute_fraction:.3f} of uncached "
            f"({1 / chosen.compute_fraction:.2f}x fewer block evaluations), PSNR min {chosen.psnr_min:.2f} dB, "
            f"mean {chosen.psnr_mean:.2f} dB over {n} prompt(s)"
        )
    return "\n".join(lines)


def calibration_record(calibration: Calibration, **run: Any) -> dict[str, Any]:
    """The profile's `calibration` object: target, criterion, what the choice achieved, `run` (model, schedule,
    size, device, date, version ... as the command knows them), the prompts, and every candidate's results."""
    chosen = calibration.chosen
    if chosen is None:
        raise ValueError("calibration_record needs a calibration that chose a candidate")
    return {
        "target_psnr_db": calibration.target_psnr,
        "criterion": calibration.criterion,
        "chosen": {"index": chosen.index, "label": chosen.label, "overrides": chosen.overrides},
        "achieved": {
            "psnr_min_db": round(chosen.psnr_min, 4),
            "psnr_mean_db": round(chosen.psnr_mean, 4),
            "compute_fraction": round(chosen.compute_fraction, 6),
            "blocks_run": sum(chosen.blocks_run.values()),
            "blocks_uncached": sum(calibration.reference_blocks),
        },
        **run,
        "prompts": [{"prompt": p, "seed": s} for p, s in calibration.samples],
        "reference_seconds": round(calibration.reference_seconds, 3),
        "candidates": [c.to_dict(calibration.samples) for c in calibration.candidates],
    }
