"""`benchmarks/sweep_substep.py`, issue 43's frontier table: the FP8 grid parses with a calibrated profile added as a
cell (the GPU recipe's `fidelity` step), and the table puts each weights kind's PSNR side by side."""

from __future__ import annotations

import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sweep_substep  # noqa: E402

from dicache.engine.cached_step import FittedWeights, feature_width  # noqa: E402
from dicache.settings.profiles import write_profile  # noqa: E402
from dicache.tuning.predictor import predictor_overrides  # noqa: E402

FP8_GRID = ROOT / "benchmarks" / "grids" / "sweep_turbo_substep_fp8.yaml"
MASK = (1, 1, 0, 1, 0, 0, 1, 0)


def calibrated_profile(folder: pathlib.Path) -> pathlib.Path:
    """A profile as `dicache calibrate` writes one for a fitted mask: its predictor named relative to it."""
    weights = {(s, "cond"): torch.zeros(feature_width(64), 64) for s in (2, 4, 5, 7)}
    FittedWeights(8, MASK, weights).save(folder / "turbo-fp8.predictors" / "mask-11010010.safetensors")
    settings = {"enable_cache": True, **predictor_overrides(MASK, "turbo-fp8.predictors/mask-11010010.safetensors")}
    return write_profile(folder / "turbo-fp8.json", settings, {"target_psnr_db": 35})


def test_the_fp8_grid_parses_with_a_calibrated_profile_as_one_more_cell(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the grid names its training prompts relative to the repository root
    profile = calibrated_profile(tmp_path)
    out = tmp_path / "sweep"
    argv = ["--grid", str(FP8_GRID), "--out", str(out), "--profile", str(profile), "--dry-run"]
    assert sweep_substep.main(argv) == 0
    printed = capsys.readouterr().out
    assert "methods: ours, ours-fp8" in printed and "samples (16)" in printed
    assert "cells (10):" in printed  # the grid's 9 and the profile's
    grid = json.loads((out / "grid_with_profiles.json").read_text())
    added = grid["grid"][-1]
    assert added["fitted_predictor"] == [str(tmp_path / "turbo-fp8.predictors" / "mask-11010010.safetensors")]
    assert added["scm_compute_bins"] == [[2, 1, 1]] and added["cached_step_method"] == ["fitted"]
    _, names = sweep_substep.grid_with_profiles(str(FP8_GRID), [str(profile)], tmp_path / "again")
    [(label, name)] = names.items()
    assert name == "turbo-fp8" and f"  {label}\n" in printed  # the label the sweep gives the cell


def record(method: str, settings: dict | None, psnr: float, worst: float, compute: float) -> dict:
    return {
        "method": method,
        "setting": json.dumps(settings, sort_keys=True),
        "settings": settings,
        "schedule": {"steps": 8, "guidance_scale": 1.0},
        "compute_fraction": compute,
        "flops_ratio": compute + 0.01,
        "psnr": psnr,
        "psnr_min": worst,
    }


def test_the_table_puts_bf16_and_fp8_side_by_side():
    fitted = predictor_overrides(MASK)
    profile = predictor_overrides(MASK, "/p/mask.safetensors")
    dynamic = {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.24}
    results = {
        "meta": {"model_id": "embedded|bfloat16|cuda"},
        "records": [
            record("uncached", None, 100.0, 100.0, 1.0),
            record("ours", fitted, 36.5, 31.2, 0.5),
            record("ours", dynamic, 30.0, 25.0, 0.6),  # not a static mask: left out
            record("ours", profile, 36.4, 31.0, 0.5),
            record("fewer-steps", None, 20.0, 15.0, 0.5),
            record("ours-fp8", {"policy": "never"}, 40.5, 31.4, 1.0),
            record("ours-fp8", fitted, 35.1, 29.9, 0.5),
            record("ours-fp8", profile, 35.0, 29.8, 0.5),
        ],
    }
    rows = sweep_substep.rows_of(results, {json.dumps(profile, sort_keys=True): "turbo-fp8"})
    assert [(r["method"], r["computed steps"]) for r in rows] == [
        ("fitted", "0,1,3,6"),
        ("profile turbo-fp8", "0,1,3,6"),
        ("uncached", "all"),
    ]
    assert rows[0] == {
        "method": "fitted",
        "computed steps": "0,1,3,6",
        "compute": "0.500",
        "FLOPs": "0.510",
        "bf16 PSNR": "36.50",
        "bf16 worst": "31.20",
        "FP8 PSNR": "35.10",
        "FP8 worst": "29.90",
    }
    assert rows[1]["FP8 PSNR"] == "35.00" and rows[2]["FP8 PSNR"] == "40.50" and rows[2]["bf16 PSNR"] == "reference"
    unquantized = {**results, "records": results["records"][:5]}  # no quantization axis: the one-column table
    assert [set(r) for r in sweep_substep.rows_of(unquantized)] == [
        {"method", "computed steps", "compute", "FLOPs", "PSNR mean", "worst"}
    ] * 2
