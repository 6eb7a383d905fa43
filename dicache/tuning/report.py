"""What a calibration writes: the chosen candidate as profile settings, the results table, the profile's
`calibration` record."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..settings.cache_config import SETTINGS
from .search import Calibration, CandidateResult


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


BIN_HALF_WIDTH = 0.05
"""A compute budget f holds the candidates with compute in [f − 0.05, f + 0.05), as a sweep report's bin does."""


def best_per_budget(calibration: Calibration, budgets: Sequence[float]) -> list[tuple[float, CandidateResult | None]]:
    """For each budget, the complete candidate in its bin with the highest criterion PSNR (ties: less compute, then
    the earlier candidate), or None: the settings a sweep should measure per compute bin, chosen on the calibration's
    prompts alone."""
    out = []
    for budget in budgets:
        lo, hi = budget - BIN_HALF_WIDTH - 1e-9, budget + BIN_HALF_WIDTH - 1e-9
        inside = [
            r
            for r in calibration.candidates
            if r.status == "complete" and r.compute_fraction is not None and lo <= r.compute_fraction < hi
        ]
        best = max(inside, key=lambda r: (r.score(calibration.criterion), -r.compute_fraction, -r.index), default=None)
        out.append((budget, best))
    return out


def budget_grid(
    calibration: Calibration, budgets: Sequence[float], cachedit_grid: Any = None
) -> tuple[dict[str, Any], list[str]]:
    """A `dicache sweep --grid` file's content: `grid`, one cell per budget's best candidate (`best_per_budget`; a
    value that is itself a list is wrapped so the grid does not expand it), `compute_targets` the budgets and, when
    given, `cachedit_grid` (cache-dit cannot run most calibrated settings: whole-step reuse, sigma distances); and
    one line per budget saying what was chosen. A fitted-predictor candidate is finalized first (`Calibration.
    finalize`: its predictor fitted on every calibration prompt)."""
    cells, lines = [], []
    for budget, best in best_per_budget(calibration, budgets):
        if best is None:
            lines.append(f"budget {budget:g}: no complete candidate with compute in its bin")
            continue
        lines.append(
            f"budget {budget:g}: #{best.index} {best.label} (compute {best.compute_fraction:.3f}, "
            f"{calibration.criterion} PSNR {best.score(calibration.criterion):.2f} dB)"
        )
        calibration.finalize(best)  # a fitted predictor's cell names its fit on every calibration prompt
        cell = {key: [value] for key, value in dict(best.overrides).items()}
        if cell not in cells:
            cells.append(cell)
    grid: dict[str, Any] = {"grid": cells, "compute_targets": list(budgets)}
    if cachedit_grid is not None:
        grid["cachedit_grid"] = cachedit_grid
    return grid, lines
