"""The Flux.1-dev speed benchmark (benchmarks/bench_family_speed.py) end to end on its tiny config (CPU, eager):
every run is in the table and the JSON, dicache and cache-dit compute the same steps and agree; settings cache-dit
has no counterpart of get the nearest ones and an extra dicache run with exactly those."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("cache_dit")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_family_speed  # noqa: E402

from dicache.engine.policies import step_mask  # noqa: E402
from dicache.errors import ConfigError  # noqa: E402
from dicache.settings.cache_config import CacheConfig  # noqa: E402
from dicache.settings.profiles import write_profile  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["--tiny", "--modes", "eager", "--reps", "1"]


def run(tmp_path, capsys, *extra: str) -> tuple[int, dict, str]:
    out = tmp_path / "speed.json"
    code = bench_family_speed.main([*TINY, "--out", str(out), *extra])
    return code, json.loads(out.read_text()), capsys.readouterr().out


def test_default_settings_both_caches_compute_the_medium_mask_and_agree(tmp_path, capsys):
    code, results, text = run(tmp_path, capsys)
    assert code == 0 and results["same_computed_steps"]
    rows = {r["run"]: r for r in results["rows"]}
    assert list(rows) == ["no cache", "dicache never", "cache-dit RDT 0", "dicache", "cache-dit"]
    assert results["cache_dit_changes"] == {}
    for name in ("no cache", "dicache never", "cache-dit RDT 0"):
        assert rows[name]["eager"]["computed"] == 28
    assert rows["dicache"]["eager"]["computed"] == rows["cache-dit"]["eager"]["computed"] == 15  # medium: 15 of 28
    ours = rows["dicache"]["eager"]
    assert ours["psnr_vs_cache_dit_db"] > 60 and ours["rel_l2_vs_cache_dit"] < 1e-3
    assert ours["psnr_vs_no_cache_db"] < ours["psnr_vs_cache_dit_db"]  # cached: close to cache-dit, not to no cache
    assert rows["dicache never"]["eager"]["psnr_vs_no_cache_db"] == float("inf")  # hooks alone change nothing
    assert ours["vs_cache_dit"] == pytest.approx(ours["s"] / rows["cache-dit"]["eager"]["s"])
    for row in rows.values():
        assert f"| {row['label']} | {row['eager']['computed']} of 28 |" in text
    assert "- eager: dicache" in text and "MISMATCH" not in text


def test_a_profile_cache_dit_cannot_take_runs_the_nearest_settings_on_both(tmp_path, capsys):
    profile = tmp_path / "flux.json"
    settings = {
        "enable_cache": True,
        "Fn_compute_blocks": 0,
        "scm_compute_bins": [4, 2, 1, 1, 1, 2],
        "scm_cache_bins": [2, 3, 3, 3, 6],
        "scm_policy": "static",
        "enable_taylorseer": True,
        "taylorseer_order": 2,
        "forecaster": "corrected",
    }
    write_profile(profile, settings, {"target_psnr_db": 30})
    code, results, text = run(tmp_path, capsys, "--profile", str(profile))
    assert code == 0 and results["same_computed_steps"]
    assert results["cache_dit_changes"] == {"Fn_compute_blocks": 1, "forecaster": "taylor"}
    assert results["cache_dit_settings"]["taylorseer_order"] == 2
    rows = {r["run"]: r for r in results["rows"]}
    assert "dicache, cache-dit's settings" in rows
    runs = ("dicache", "dicache, cache-dit's settings", "cache-dit")
    computed = {name: rows[name]["eager"]["computed"] for name in runs}
    mask = "1111001100010001000100000011"  # the bins: 11 of 28 computed
    assert set(computed.values()) == {mask.count("1")} == {11}, computed
    assert mask in text  # the mask in the labels
    assert rows["dicache, cache-dit's settings"]["eager"]["psnr_vs_cache_dit_db"] > 60
    assert "cache-dit has no counterpart of some" in text


def test_counterpart_resets_inert_forecaster_settings_silently_and_refuses_other_policies():
    off = CacheConfig.defaults().merged(
        {"taylorseer_damping": 0.5, "taylorseer_distance": "sigma", "scm_preset": "fast", "scm_policy": "static"}
    )
    counterpart, changes = bench_family_speed.cache_dit_counterpart(off)
    assert changes == {} and counterpart.taylorseer_damping == 1.0 and counterpart.taylorseer_distance == "step"
    assert counterpart.scm_preset == "fast"
    on = off.merged({"enable_taylorseer": True})
    assert bench_family_speed.cache_dit_counterpart(on)[1] == {"taylorseer_damping": 1.0, "taylorseer_distance": "step"}
    with pytest.raises(ConfigError, match="policy='teacache'"):
        bench_family_speed.cache_dit_counterpart(CacheConfig.defaults().merged({"policy": "teacache"}))


def test_a_fitted_profile_is_timed_against_cache_dit_on_the_same_mask_with_its_cached_residual(tmp_path):
    predictor = tmp_path / "w.safetensors"
    predictor.write_bytes(b"")
    fitted = CacheConfig.defaults().merged(
        {
            "scm_compute_bins": [5, 1, 1, 1, 1, 1, 1],
            "scm_cache_bins": [2, 2, 2, 3, 4, 4],
            "scm_policy": "static",
            "max_warmup_steps": 0,
            "Fn_compute_blocks": 0,
            "Bn_compute_blocks": 0,
            "enable_taylorseer": False,
            "cached_step_method": "fitted",
            "fitted_predictor": str(predictor),
        }
    )
    counterpart, changes = bench_family_speed.cache_dit_counterpart(fitted)
    assert changes == {"Fn_compute_blocks": 1, "cached_step_method": "forecast", "fitted_predictor": None}
    assert step_mask(counterpart, 28) == step_mask(fitted, 28) and sum(step_mask(fitted, 28)) == 11


def test_a_mask_that_does_not_fit_28_steps_is_refused_before_the_model_is_built(tmp_path, capsys):
    profile = tmp_path / "short.json"
    write_profile(profile, {"scm_compute_bins": [4, 2], "scm_cache_bins": [2], "scm_policy": "static"}, {})
    assert bench_family_speed.main([*TINY, "--profile", str(profile)]) == 2
    captured = capsys.readouterr()
    assert "scm_compute_bins" in captured.err and "built:" not in captured.out


def test_a_failing_compiled_mode_keeps_the_eager_results_and_exits_1(tmp_path, capsys):
    out = tmp_path / "speed.json"
    argv = ["--tiny", "--modes", "eager,compiled", "--compile-backend", "no-such-backend", "--reps", "1"]
    assert bench_family_speed.main([*argv, "--out", str(out)]) == 1
    results = json.loads(out.read_text())
    assert list(results["errors"]) == ["compiled"] and "no-such-backend" in results["errors"]["compiled"]
    assert all("eager" in r and "compiled" not in r for r in results["rows"])
    assert "**compiled failed**" in capsys.readouterr().out
