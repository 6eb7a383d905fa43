"""`benchmarks/bench_serving.py --profile` / `--fitted-mask`: a calibrated profile and a fitted predictor's timing
stand-in as cache modes, through a real `dicache serve` on the tiny configs (CPU, random weights), beside the
recommended setting; each row says the steps its requests computed (the answers' `cache_stats`)."""

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
    argv += ["--caches", "recommended", "--profile", str(profile), "--fitted-mask", "0,1,3"]
    argv += ["--requests-c1", "1", "--requests-c20", "0", "--start-timeout", "240"]
    try:
        assert bench_serving.main([*argv, "--results", str(tmp_path / "RESULTS.md")]) == 0
    finally:
        for name in ("turbo-fitted", "fitted-stand-in 0,1,3"):
            bench_serving.CACHE_MODES.pop(name, None)
            bench_serving.MODE_STEPS.pop(name, None)
    results = json.loads((tmp_path / "bench_serving.json").read_text())
    rows = {r["cache"]: r for r in results["runs"]}
    assert rows["turbo-fitted"]["computed_steps"] == "0,1,3,6" and rows["turbo-fitted"]["compute"] == 0.5
    assert rows["recommended"]["computed_steps"] == "0,1,2,4,6" and rows["recommended"]["compute"] == 0.625
    stand_in = rows["fitted-stand-in 0,1,3"]
    assert stand_in["computed_steps"] == "0,1,3" and stand_in["compute"] == 0.375
    [archived] = (tmp_path / "results" / "archive").iterdir()
    text = archived.read_text()
    assert "`turbo-fitted`: " in text and "calibrated on krea2-tiny-turbo; 8 steps; target mean PSNR >= 35.0 dB" in text
    assert "Timing stand-ins (`fitted-stand-in 0,1,3`)" in text


def test_a_predictor_runs_only_with_the_variant_of_its_step_count(monkeypatch):
    monkeypatch.setitem(bench_serving.MODE_STEPS, "turbo-fitted", 8)
    args = bench_serving.argparse.Namespace(
        variants=["turbo", "raw"], caches=["off", "turbo-fitted"], requests_c1=3, requests_c20=0, raw_requests=1
    )
    assert bench_serving.plan(args) == [("turbo", "off", 1, 3), ("turbo", "turbo-fitted", 1, 3), ("raw", "off", 1, 1)]


def test_a_bad_profile_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_serving.main(["--tiny", "--device", "cpu", "--profile", str(tmp_path / "none.json")])
    assert stop.value.code == 2 and f"--profile '{tmp_path / 'none.json'}': no such file" in capsys.readouterr().err
    taken = tmp_path / "recommended.json"
    taken.write_text(json.dumps({"settings": {"enable_cache": True}}))
    with pytest.raises(SystemExit):
        bench_serving.main(["--tiny", "--device", "cpu", "--profile", str(taken)])
    assert "its name 'recommended' is taken" in capsys.readouterr().err
    for bad in ("1,3", "0,1,8", "0,1,2,3,4,5,6,7", "a"):
        with pytest.raises(SystemExit):
            bench_serving.main(["--tiny", "--device", "cpu", "--fitted-mask", bad])
        assert f"--fitted-mask {bad!r} is invalid" in capsys.readouterr().err


def test_the_timed_runs_start_once_the_prompt_lengths_met_after_ready_are_done(tmp_path):
    """`wait_steady` against a real server: None where nothing runs after ready (a CPU server); while the
    background preparation (`--prepare-text-lengths background`) is still meeting lengths it waits, naming it when
    its time runs out; it returns once every length is met. A keyed server asked without its key is an error."""
    import threading

    import httpx
    from server_helpers import backend_with_env, pipeline_source

    from dicache.commands.serve import parse_serve_argv, settings_from_args
    from dicache.server import create_app
    from dicache.server.background import BackgroundServer
    from dicache.server.text_lengths import TextLengthPreparation

    backend = backend_with_env(pipeline_source(tmp_path), {}, variant="turbo")
    gate, met = threading.Event(), []

    def prepare(chunk):  # a chunk of the GPU's work, held until the gate opens
        gate.wait(30)
        met.extend(chunk)

    try:
        with BackgroundServer(create_app(backend, settings_from_args(parse_serve_argv([])))) as server:
            assert bench_serving.wait_steady(server.url, 5) is None
            backend.startup = {"phases_s": {}}
            backend.text_lengths = TextLengthPreparation(prepare, range(1, 7), backend.busy).start()
            with pytest.raises(RuntimeError, match=r"still being met after 1 s: .*'state': 'running'"):
                bench_serving.wait_steady(server.url, 1)
            threading.Timer(0.5, gate.set).start()
            assert bench_serving.wait_steady(server.url, 30) >= 0
            assert met == [6, 5, 4, 3, 2, 1] and backend.text_lengths.progress()["state"] == "done"
        keyed = settings_from_args(parse_serve_argv(["--api-key", "k-123"]))
        with BackgroundServer(create_app(backend, keyed)) as server:  # a refused question is an error, not "none"
            with pytest.raises(httpx.HTTPStatusError, match="401"):
                bench_serving.wait_steady(server.url, 5)
            assert bench_serving.wait_steady(server.url, 5, {"Authorization": "Bearer k-123"}) >= 0
    finally:
        gate.set()
        backend.close()
