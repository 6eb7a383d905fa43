"""`benchmarks/bench_serving.py --profile`: a calibrated profile as a cache mode, through a real `dicache serve` on
the tiny configs (CPU, random weights), beside the recommended setting; each row says the steps its requests computed
(the answers' `cache_stats`)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("fastapi")  # the serve extra

import bench_serving  # noqa: E402

from dicache.engine.cached_step import FittedWeights, feature_width  # noqa: E402
from dicache.settings.profiles import write_profile  # noqa: E402
from dicache.tuning.predictor import predictor_overrides  # noqa: E402

MASK = (1, 1, 0, 1, 0, 0, 1, 0)


def fitted_profile(folder: pathlib.Path) -> pathlib.Path:
    """A profile as calibrate writes one for the fitted mask 0,1,3,6 (the predictor: the newest output, reused)."""

    def reuse() -> torch.Tensor:
        w = torch.zeros(feature_width(64), 64)
        w[:64] = torch.eye(64)
        return w

    FittedWeights(8, MASK, {(s, "cond"): reuse() for s in (2, 4, 5, 7)}).save(folder / "p.predictors" / "m.safetensors")
    record = {"target_psnr_db": 35.0, "criterion": "mean", "model_source": "/x/krea2-tiny-turbo", "steps": 8}
    record["achieved"] = {"psnr_mean_db": 36.1, "psnr_min_db": 31.0, "compute_fraction": 0.5}
    settings = {"enable_cache": True, **predictor_overrides(MASK, "p.predictors/m.safetensors")}
    return write_profile(folder / "turbo-fitted.json", settings, record)


def test_a_profile_is_a_cache_mode_the_server_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    profile = fitted_profile(tmp_path)
    argv = ["--tiny", "--device", "cpu", "--servers", "none", "--no-compile", "--variants", "turbo"]
    argv += ["--caches", "recommended", "--profile", str(profile), "--requests-c1", "1", "--requests-c20", "0"]
    argv += ["--start-timeout", "240", "--results", str(tmp_path / "RESULTS.md")]
    try:
        assert bench_serving.main(argv) == 0
    finally:
        bench_serving.CACHE_MODES.pop("turbo-fitted", None)
    results = json.loads((tmp_path / "bench_serving.json").read_text())
    rows = {r["cache"]: r for r in results["runs"]}
    assert rows["turbo-fitted"]["computed_steps"] == "0,1,3,6" and rows["turbo-fitted"]["compute"] == 0.5
    assert rows["recommended"]["computed_steps"] == "0,1,2,4,6" and rows["recommended"]["compute"] == 0.625
    [archived] = (tmp_path / "results" / "archive").iterdir()
    text = archived.read_text()
    assert "`turbo-fitted`: " in text and "calibrated on krea2-tiny-turbo; 8 steps; target mean PSNR >= 35.0 dB" in text


def test_a_bad_profile_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_serving.main(["--tiny", "--device", "cpu", "--profile", str(tmp_path / "none.json")])
    assert stop.value.code == 2 and f"--profile '{tmp_path / 'none.json'}': no such file" in capsys.readouterr().err
    taken = tmp_path / "recommended.json"
    taken.write_text(json.dumps({"settings": {"enable_cache": True}}))
    with pytest.raises(SystemExit):
        bench_serving.main(["--tiny", "--device", "cpu", "--profile", str(taken)])
    assert "its name 'recommended' is taken" in capsys.readouterr().err
