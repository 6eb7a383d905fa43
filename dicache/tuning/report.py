"""What a calibration writes: the chosen candidate as profile settings, the results table, the profile's
`calibration` record."""

from __future__ import annotations

import math
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
