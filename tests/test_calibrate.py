"""`dicache calibrate` and `--profile`: calibration logic on a scripted runner, then the real command on the embedded
checkpoint at 64 px (profile written and loadable; `generate --profile` reproduces the chosen settings and meets the
target; an unreachable target exits 2 and writes nothing; `--profile` errors; `serve --profile`)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from dicache.cli import main
from dicache.errors import ConfigError
from dicache.settings.cache_config import PROFILE_ENV, CacheConfig, load_profile
from dicache.settings.profiles import write_profile
from dicache.sweep.metrics import psnr
from dicache.sweep.settings import cell_label
from dicache.tuning import (
    CANDIDATES,
    Measurement,
    calibrate,
    calibration_record,
    check_candidate,
    format_table,
    profile_settings,
)
from dicache.tuning.masks import beam_search, computed_steps, hill_climb, mask_bins, mask_overrides, moved

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

SCHEDULE = ["--steps", "8", "--guidance", "4.5"]  # CFG: two branches per step, both counted
SIZE = 64
TARGET = 35.0
# The most aggressive misses 35 dB on the embedded model at this schedule, one caches nothing, one cannot split.
TEST_CANDIDATES = [
    {"residual_diff_threshold": 0.32},
    {"residual_diff_threshold": 0.2},
    {"residual_diff_threshold": 0.04},
    {"Fn_compute_blocks": 10},
    {"policy": "magcache", "magcache_thresh": 0.3},  # valid only over the fitted ratios
]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("SGLANG_CACHE_DIT_")]:
        monkeypatch.delenv(name)


# ---------------------------------------------------------------------------------------------- scripted runner
class ScriptedRunner:
    """A `Runner` whose cached images have a scripted PSNR per (threshold, sample) and a scripted block count."""

    num_blocks, steps, calls = 10, 8, 16

    def __init__(self, prompts, script):
        self.prompts, self.script, self.log = prompts, script, []

    def run(self, prompt, seed, config):
        reference = torch.full((3, 8, 8), 0.5)
        total = self.calls * self.num_blocks
        if config is None:
            return Measurement(reference, total, total, 0.0)
        rdt = config.residual_diff_threshold
        self.log.append((rdt, prompt))
        dbs, blocks = self.script[rdt]
        db = dbs[self.prompts.index(prompt)]
        return Measurement(reference + 10 ** (-db / 20), blocks, total, 0.0)  # MSE = 10^(-db/10)


def scripted(criterion="min", early_stop=True, target=TARGET, extra=()):
    prompts = ["p0", "p1", "p2"]
    script = {
        0.1: ([40.0, 40.0, 40.0], 144),  # meets min and mean, compute 0.9
        0.2: ([50.0, 30.0, 50.0], 96),  # mean 43.3 meets, min 30 does not; compute 0.6
        0.3: ([20.0, 20.0, 45.0], 64),  # neither; compute 0.4
    }
    runner = ScriptedRunner(prompts, script)
    rejected = []
    candidates = [{"residual_diff_threshold": r} for r in script] + list(extra)
    result = calibrate(
        runner,
        [(p, 0) for p in prompts],
        candidates,
        target_psnr=target,
        criterion=criterion,
        early_stop=early_stop,
        progress=False,
        on_reject=rejected.append,
    )
    return result, runner.log, rejected


def test_worst_case_choice_early_stop_and_hardest_prompt_first():
    result, log, rejected = scripted(extra=[{"Fn_compute_blocks": 10}, {"no_such_knob": 1}])
    assert result.chosen.overrides == {"residual_diff_threshold": 0.1}
    assert result.chosen.compute_fraction == pytest.approx(0.9) and result.chosen.psnr_min == pytest.approx(40.0)
    by_rdt = {c.overrides.get("residual_diff_threshold"): c for c in result.candidates}
    # 0.2 stops at its first prompt below 35 dB; 0.3 then starts on the prompt found hardest (p1) and stops at once
    assert log == [(0.1, "p0"), (0.1, "p1"), (0.1, "p2"), (0.2, "p0"), (0.2, "p1"), (0.3, "p1")]
    assert by_rdt[0.2].status == by_rdt[0.3].status == "stopped" and not by_rdt[0.2].meets_target
    assert "rules out min >= 35 dB" in by_rdt[0.3].error
    invalid = [c for c in result.candidates if c.status == "invalid"]
    assert [c.index for c in invalid] == [3, 4] and [r.index for r in rejected] == [3, 4]
    assert "Fn_compute_blocks=10" in invalid[0].error and "'no_such_knob'" in invalid[1].error
    table = format_table(result)
    assert "<- chosen" in table and "invalid: " in table and "no (stopped early)" in table
    assert "0.900" in table and "40.00" in table


def test_mean_criterion_and_no_early_stop():
    result, log, _ = scripted(criterion="mean", early_stop=False)
    assert result.chosen.overrides == {"residual_diff_threshold": 0.2}  # mean 43.3 dB at compute 0.6
    assert result.chosen.psnr_mean == pytest.approx(130 / 3)
    assert len(log) == 9 and all(c.status == "complete" for c in result.candidates)
    by_rdt = {c.overrides["residual_diff_threshold"]: c for c in result.candidates}
    assert by_rdt[0.1].meets_target and by_rdt[0.2].meets_target and not by_rdt[0.3].meets_target


def test_unreachable_target_names_it_and_the_best_psnr():
    result, _, _ = scripted(target=45.0)
    assert result.chosen is None
    message = result.failure_message()
    assert "45 dB" in message and "the best PSNR achieved is 40.00 dB" in message and "nothing written" in message


def test_builtin_candidates_are_valid_and_distinct_for_the_embedded_model():
    keys = [json.dumps(c, sort_keys=True) for c in CANDIDATES]
    assert len(set(keys)) == len(keys) >= 10
    for steps in (8, 28, 50):
        for candidate in CANDIDATES:
            config = check_candidate(candidate, num_blocks=10, steps=steps)
            assert config.enable_cache and all(getattr(config, k) == v for k, v in candidate.items())


def test_mask_bins_and_the_beam_search_on_a_scored_profile():
    assert mask_bins((1, 1, 1, 0, 1, 0, 1, 0)) == ([3, 1, 1], [1, 1, 1])
    assert mask_bins((1, 0, 0)) == ([1], [2]) and computed_steps((1, 0, 1)) == [0, 2]
    with pytest.raises(ValueError, match="starting with a computed step"):
        mask_bins((0, 1))
    config = check_candidate(mask_overrides((1, 1, 1, 0, 1, 0, 1, 0)), num_blocks=10, steps=8)
    assert config.forecaster == "input_corrected" and config.Fn_compute_blocks == 0
    assert "SCM bins 3-1-1/1-1-1/static" in cell_label(config)  # both run lists: masks with equal compute runs differ
    # a step's worth: each computed step adds its weight; dropping one loses it. The search keeps the heaviest.
    weights = (9, 1, 5, 2, 8, 3, 7, 4)
    scored = []

    def score(mask):
        scored.append(mask)
        return float(sum(w for w, f in zip(weights, mask) if f))

    found = dict(beam_search(8, score, target=30.0, beam=2))
    assert len(scored) == len(set(scored)) == len(found)  # each mask scored once
    best = {}
    for mask, value in found.items():
        k = sum(mask)
        if value > best.get(k, (None, -1))[1]:
            best[k] = (mask, value)
    assert computed_steps(best[7][0]) == [0, 2, 3, 4, 5, 6, 7] and best[5][1] == 9 + 8 + 7 + 5 + 4
    # stops after the first round in which no mask kept meets the target (33 with 5 steps, 29 with 4)
    assert min(best) == 4 and best[4][1] == 9 + 8 + 7 + 5


def test_moves_and_the_hill_climb_on_a_scored_profile():
    # step 0 stays; each other computed step moves by -1, +1, -2, +2 onto a cached step inside the schedule
    assert moved((1, 1, 0, 1, 0)) == [(1, 0, 1, 1, 0), (1, 1, 1, 0, 0), (1, 1, 0, 0, 1)]
    # a step's worth as in the beam search; the climb ends on a local best: [0, 4, 6] (12), while [0, 2, 4] (13)
    # is two moves away through worse masks. After [0, 2, 6] (9) the scan goes on from the next move: [0, 3, 6]
    # (6), then [0, 4, 6]; from there the scan starts at [0, 4, 5]
    weights = (0, 1, 5, 2, 8, 3, 4, 0)
    scored = []

    def score(mask):
        scored.append(mask)
        return float(sum(w for w, f in zip(weights, mask) if f))

    start = (1, 1, 0, 0, 0, 0, 1, 0)  # 1 + 4
    found = hill_climb(start, score, budget=50)
    assert len(scored) == len(set(scored)) == len(found) and found[0] == (start, 5.0)
    best = max(found, key=lambda f: f[1])
    assert computed_steps(best[0]) == [0, 4, 6] and best[1] == 12 and found[-1][1] < 12  # then no move gains
    assert all(sum(m) == 3 and m[0] == 1 for m, _ in found)  # the compute never changes
    # first improvement: 1 -> 2 (+4) is taken before any later move is scored
    assert found[1] == ((1, 0, 1, 0, 0, 0, 1, 0), 9.0) and len(hill_climb(start, score, budget=3)) == 3
    assert [computed_steps(m) for m, _ in found[2:5]] == [[0, 3, 6], [0, 4, 6], [0, 4, 5]]
    # from the top (its score given), every neighbour is scored once, then it stops
    top = hill_climb(best[0], score, known={best[0]: 12.0}, budget=50)
    assert len(top) == len(moved(best[0])) == 5 and max(v for _, v in top) < 12
    # a gain within min_gain is no gain
    assert len(hill_climb(start, score, known={start: 5.0}, budget=50, min_gain=4.5)) == len(moved(start))


def test_calibrate_searches_step_masks_and_picks_one_on_the_tiny_model(tmp_path, capsys):
    candidates = tmp_path / "c.json"
    candidates.write_text(json.dumps([{"residual_diff_threshold": 0.5}]))  # caches nothing at 4 steps (W 4)
    out = tmp_path / "masks.json"
    argv = ["calibrate", "--variant", "turbo", "--steps", "4", "--size", "32", "--prompts", "1", "--device", "cpu"]
    argv += ["--fit-seeds", "0"]  # the whole-step masks alone (the fitted predictor's search: its own test)
    code = main([*argv, "--candidates", str(candidates), "--target-psnr", "40", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    record = json.loads(out.read_text())["calibration"]
    results = record["candidates"]
    masks = [c for c in results if "scm_compute_bins" in c["overrides"]]
    assert len(masks) >= 3 and all(c["status"] == "complete" for c in masks)  # every sample, no early stop
    chosen = results[record["chosen"]["index"]]
    assert chosen in masks and chosen["overrides"]["forecaster"] == "input_corrected"
    assert chosen["psnr_min_db"] >= 40 and chosen["compute_fraction"] <= 0.75
    assert min(c["compute_fraction"] for c in masks if c["meets_target"]) == chosen["compute_fraction"]
    assert "FORECASTER=input_corrected" in printed and "<- chosen" in printed


def test_profile_writer_refuses_what_load_profile_would_refuse(tmp_path):
    path = tmp_path / "bad.json"
    with pytest.raises(ConfigError, match="residual_diff_threshold"):
        write_profile(path, {"residual_diff_threshold": -1.0}, {})
    with pytest.raises(ConfigError, match="unknown key"):
        write_profile(path, {"threshold": 0.1}, {})
    assert list(tmp_path.iterdir()) == []  # neither the profile nor a temporary file is left
    result, _, _ = scripted()
    written = write_profile(path, profile_settings(result.chosen), calibration_record(result, steps=8))
    assert load_profile(written)["residual_diff_threshold"] == 0.1
    assert CacheConfig.from_env({PROFILE_ENV: str(written)}).sources()["residual_diff_threshold"].startswith("profile")


# ---------------------------------------------------------------------------------------------- the real command
@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("calibrate")
    candidates = folder / "candidates.json"
    candidates.write_text(json.dumps(TEST_CANDIDATES))
    out = folder / "profile.json"
    argv = ["calibrate", *SCHEDULE, "--size", str(SIZE), "--prompts", "2", "--candidates", str(candidates)]
    argv += ["--out", str(out), "--device", "cpu", "--no-progress", "--target-psnr", str(TARGET), "--no-step-masks"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(argv)
    assert code == 0, printed.getvalue()
    return out, json.loads(out.read_text()), printed.getvalue()


def test_calibrate_writes_the_cheapest_profile_meeting_the_target(calibrated):
    path, profile, printed = calibrated
    settings, record = profile["settings"], profile["calibration"]
    assert load_profile(path) == settings and settings["enable_cache"] is True
    config = CacheConfig.from_env({PROFILE_ENV: str(path)})
    assert {k for k, origin in config.sources().items() if origin == f"profile {path}"} == set(settings)

    assert record["target_psnr_db"] == TARGET and record["criterion"] == "min"
    assert (record["steps"], record["guidance_scale"], record["width"], record["height"]) == (8, 4.5, SIZE, SIZE)
    assert record["model"] is None and record["num_blocks"] == 10 and record["dicache_version"]
    assert [p["seed"] for p in record["prompts"]] == [1000, 1001]  # the held-out prompts' own seeds
    results = record["candidates"]
    assert [c["status"] for c in results][3] == "invalid" and "Fn_compute_blocks=10" in results[3]["error"]
    assert len(results) == len(TEST_CANDIDATES)  # --no-step-masks: no mask searched

    chosen = results[record["chosen"]["index"]]
    assert chosen["overrides"] == record["chosen"]["overrides"]
    assert all(settings[k] == v for k, v in chosen["overrides"].items())
    assert chosen["status"] == "complete" and chosen["psnr_min_db"] >= TARGET
    assert record["achieved"]["psnr_min_db"] == chosen["psnr_min_db"] >= TARGET
    assert 0 < record["achieved"]["compute_fraction"] < 1  # it really saves compute
    for c in results:  # the least compute among those meeting the target; some cheaper one did not meet it
        if c["meets_target"]:
            assert c["compute_fraction"] >= chosen["compute_fraction"]
        if c["status"] == "complete":
            assert c["meets_target"] == (c["psnr_min_db"] >= TARGET)
    assert any(c["compute_fraction"] and c["compute_fraction"] < chosen["compute_fraction"] for c in results)
    assert "<- chosen" in printed and f"wrote {path}" in printed and "invalid: Fn_compute_blocks=10" in printed
    # the fits ran on the first prompt and are stored: MagCache's ratios (one per step, 1 at step 0), TeaCache's
    # rising polynomial (degree <= 4); the MagCache candidate ran over them
    assert record["fitted_on"] == record["prompts"][0] and "fitted on" in printed
    ratios = settings["magcache_ratios"]
    assert len(ratios) == 8 and ratios[0] == 1.0 and all(0 < r < 10 for r in ratios) and len(set(ratios)) > 2
    assert 2 <= len(settings["teacache_coefficients"]) <= 5
    assert results[4]["status"] != "invalid"


def test_generate_with_the_profile_uses_its_settings_and_meets_the_target(calibrated, tmp_path, capsys):
    path, profile, _ = calibrated
    chosen = profile["calibration"]["candidates"][profile["calibration"]["chosen"]["index"]]
    hardest = min(chosen["per_sample"], key=lambda s: s["psnr_db"])
    argv = ["generate", hardest["prompt"], "--seed", str(hardest["seed"]), *SCHEDULE, "--height", str(SIZE)]
    argv += ["--width", str(SIZE), "--device", "cpu"]
    stats_file = tmp_path / "stats.json"
    capsys.readouterr()
    cached_argv = ["--profile", str(path), "--out", str(tmp_path / "cached.png"), "--stats-json", str(stats_file)]
    assert main([*argv, *cached_argv]) == 0
    printed = capsys.readouterr().out
    assert f"profile {path}: {len(profile['settings'])} value(s); not the defaults: enable_cache=True" in printed
    assert "calibrated" in printed and "residual_diff_threshold=" in printed
    assert main([*argv, "--cache", "off", "--out", str(tmp_path / "plain.png")]) == 0

    stats = json.loads(stats_file.read_text())
    settings = profile["settings"]
    assert stats["config"]["profile"] == str(path)
    assert stats["config"]["sources"]["residual_diff_threshold"] == f"profile {path}"
    assert {k: stats["config"]["settings"][k] for k in settings} == settings
    assert stats["Fn_compute_blocks"] == settings["Fn_compute_blocks"] and stats["num_steps"] == 8
    assert set(stats["branches"]) == {"cond", "uncond"}
    for branch in stats["branches"].values():
        warmup = [int(s) for s, reason in branch["reasons"].items() if reason == "warmup"]
        assert warmup == list(range(settings["max_warmup_steps"]))
    blocks = hardest["blocks_run"] / hardest["blocks_total"]
    assert stats["compute_fraction"] == pytest.approx(blocks, abs=1e-6) and stats["cached_calls"] > 0

    cached, plain = (np.array(Image.open(tmp_path / n).convert("RGB")) for n in ("cached.png", "plain.png"))
    as_tensor = lambda a: torch.from_numpy(a).permute(2, 0, 1).double() / 255  # noqa: E731
    db = psnr(as_tensor(cached), as_tensor(plain))[0]
    assert db >= TARGET and math.isclose(db, hardest["psnr_db"], abs_tol=0.5)


def test_unreachable_target_exits_2_and_writes_nothing(tmp_path, capsys):
    candidates = tmp_path / "c.yaml"
    candidates.write_text("- {residual_diff_threshold: 0.04}\n- {residual_diff_threshold: 0.5}\n")
    out = tmp_path / "never.json"
    argv = ["calibrate", "--steps", "4", "--guidance", "1", "--size", "32", "--prompts", "1", "--device", "cpu"]
    code = main([*argv, "--candidates", str(candidates), "--target-psnr", "200", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2 and not out.exists() and list(tmp_path.iterdir()) == [candidates]
    assert "dicache calibrate: error: no candidate meets the target worst-case (min) PSNR >= 200 dB" in captured.err
    assert "the best PSNR achieved is 100.00 dB" in captured.err and "nothing written" in captured.err
    assert "RDT=0.5" in captured.out and "1/1" in captured.out  # the table still shows what was measured


def test_profile_option_errors_name_the_option_and_path(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    bad_value = tmp_path / "bad.json"
    bad_value.write_text(json.dumps({"settings": {"max_warmup_steps": -3}}))
    cases = [
        (missing, "no such file"),
        (broken, "not valid JSON"),
        (bad_value, "'max_warmup_steps'"),
    ]
    for path, what in cases:
        for command in (["generate", "x", "--device", "cpu"], ["config"], ["serve", "--device", "cpu"]):
            assert main([*command, "--profile", str(path)]) == 2, (command, path)
            err = capsys.readouterr().err
            assert f"--profile {str(path)!r}" in err and what in err, err


def test_profile_option_wins_over_the_variable_and_variables_win_over_both(calibrated, tmp_path, monkeypatch, capsys):
    path, profile, _ = calibrated
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"settings": {"residual_diff_threshold": 0.5, "max_warmup_steps": 7}}))
    monkeypatch.setenv(PROFILE_ENV, str(other))
    assert main(["config", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["settings"]["max_warmup_steps"] == 7 and shown["profile"] == str(other)
    monkeypatch.setenv("SGLANG_CACHE_DIT_WARMUP", "5")
    assert main(["config", "--json", "--profile", str(path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["profile"] == str(path)
    assert shown["settings"]["residual_diff_threshold"] == profile["settings"]["residual_diff_threshold"]
    assert shown["sources"]["residual_diff_threshold"] == f"profile {path}"
    assert shown["settings"]["max_warmup_steps"] == 5 and shown["sources"]["max_warmup_steps"].startswith("env ")
    assert main(["config", "--profile", str(path)]) == 0
    table = capsys.readouterr().out
    assert f"profile {path}" in table and "calibrated" in table and f"PSNR >= {TARGET:g} dB" in table


def test_serve_applies_the_profile_to_every_request(calibrated, monkeypatch):
    """The real `dicache serve --profile` (its uvicorn runner swapped for a loopback server that sends requests)."""
    from dicache.server import runner
    from dicache.server.background import BackgroundServer

    path, profile, _ = calibrated
    settings = profile["settings"]
    sample = profile["calibration"]["candidates"][profile["calibration"]["chosen"]["index"]]["per_sample"][0]
    body = dict(prompt=sample["prompt"], seed=sample["seed"], size=f"{SIZE}x{SIZE}", num_inference_steps=8)
    body["guidance_scale"] = 4.5
    seen = {}

    def serve(app, *args, **kwargs):
        with BackgroundServer(app) as server:
            seen["info"] = httpx.get(server.url + "/v1/server_info").json()
            url = server.url + "/v1/images/generations"
            seen["plain"] = httpx.post(url, json=body, timeout=120).json()
            overrides = {"max_warmup_steps": 8}  # merges over the profile: every step a warm-up step
            seen["override"] = httpx.post(url, json={**body, "cache_dit_params": overrides}, timeout=120).json()

    monkeypatch.setattr(runner, "serve", serve)
    argv = ["serve", "--profile", str(path), "--device", "cpu", "--max-side", "128", "--log-level", "warning"]
    assert main(argv) == 0

    cache = seen["info"]["cache"]
    assert cache["profile"] == str(path) and cache["enabled_by_default"] is True
    assert cache["sources"]["residual_diff_threshold"] == f"profile {path}"
    assert cache["settings"]["residual_diff_threshold"] == settings["residual_diff_threshold"]
    stats = seen["plain"]["cache_stats"]
    assert seen["plain"]["generation"]["enable_cache"] is True and stats["cached_calls"] > 0
    assert stats["compute_fraction"] == pytest.approx(sample["blocks_run"] / sample["blocks_total"], abs=1e-6)
    overridden = seen["override"]["cache_stats"]
    assert overridden["cached_calls"] == 0 and overridden["Fn_compute_blocks"] == settings["Fn_compute_blocks"]
    assert all(set(b["reasons"].values()) == {"warmup"} for b in overridden["branches"].values())


def test_load_backend_checks_its_profile_before_loading_the_model(tmp_path):
    from dicache.server import load_backend

    missing = tmp_path / "missing.json"
    with pytest.raises(ConfigError, match=f"--profile {str(missing)!r}: no such file"):
        load_backend("/nonexistent/model", profile=str(missing))
    with pytest.raises(ValueError, match="cache_config or profile, not both"):
        load_backend("/nonexistent/model", cache_config=CacheConfig.defaults(), profile=str(missing))
