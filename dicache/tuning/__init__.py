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
3a. Per-step masks (`step_masks=True`, schedules of at most `masks.MAX_MASK_STEPS` steps; before the listed
   candidates): a beam search over which steps to compute (`masks.beam_search`), each mask run on every sample;
   every mask scored is a candidate like the listed ones (`dicache calibrate` does it unless `--no-step-masks`).
4. Early stop (exact, never changes the choice): a candidate stops as soon as it can no longer qualify; under the
   `min` criterion that is the first sample below the target, under `mean` when even `PSNR_CAP_DB` on every
   remaining sample could not lift the mean to the target. Samples run hardest-first (lowest PSNR any earlier
   candidate got on them), so a failing candidate usually costs one generation.
5. The choice: among the candidates that ran on every sample and whose criterion PSNR (`min` over the samples by
   default, the safe reading of a target; or `mean`) is >= the target, the least compute fraction; ties go to the
   higher PSNR, then to the earlier candidate.

Before the candidates, `fit_algorithms` traces one uncached generation of the first sample and fits TeaCache's
rescale polynomial and MagCache's ratio profile (`fits`); every candidate runs over those values (its own keys win),
so the chosen profile stores them. `CANDIDATES` is the built-in candidate list; `profile_settings` turns the choice
into a profile's `settings`.

Modules, one job each: `fits` (the per-model fits), `candidates` (the built-in list, candidate files, checking one),
`masks` (the per-step mask search), `runner` (generating one sample: the sweep's `NativeRunner` at a fixed
schedule), `search` (the procedure above), `report` (table, profile settings and record), `errors`. Setting names
and labels come from `dicache.sweep.settings`.
"""

from __future__ import annotations

from ..sweep.settings import RECOMMENDED_FAMILY, label
from .candidates import CANDIDATES, check_candidate, load_candidates
from .errors import CalibrationError, TargetNotMet
from .fits import ResidualTrace, fit_algorithms, fit_polynomial, magcache_profile
from .report import best_per_budget, budget_grid, calibration_record, format_table, profile_settings
from .runner import Measurement, PipelineRunner, Runner
from .search import CRITERIA, Calibration, CandidateResult, Criterion, calibrate

__all__ = [
    "CANDIDATES",
    "CRITERIA",
    "RECOMMENDED_FAMILY",
    "Calibration",
    "CalibrationError",
    "CandidateResult",
    "Criterion",
    "Measurement",
    "PipelineRunner",
    "ResidualTrace",
    "Runner",
    "TargetNotMet",
    "best_per_budget",
    "budget_grid",
    "calibrate",
    "calibration_record",
    "check_candidate",
    "fit_algorithms",
    "fit_polynomial",
    "format_table",
    "label",
    "load_candidates",
    "magcache_profile",
    "profile_settings",
]
