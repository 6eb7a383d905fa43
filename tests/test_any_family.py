"""The tools on any registered family (issue 42): `dicache generate`, `calibrate` and `sweep` on diffusers pipeline
folders of two families (Flux.1: true CFG in two calls a step; PixArt-Σ: batched CFG, DDIM without sigmas), from the
command line and from Python, and the settings a family cannot take refused before any run, naming the setting and
the family. The trained Flux checkpoint (`checkpoints/flux-tiny`, from `scripts/train_flux_tiny.py`) runs the same
way once it is in the repository."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

import dicache  # noqa: E402
from dicache.cli import main  # noqa: E402

TRAINED_FLUX = Path(__file__).resolve().parents[1] / "checkpoints" / "flux-tiny"
FAST = [{"residual_diff_threshold": 0.3, "max_warmup_steps": 1}, {"scm_preset": "fast", "scm_policy": "static"}]


def test_generate_on_a_video_family_writes_each_finite_video_as_an_animated_image(tmp_path, capsys, one_torch_thread):
    """Wan 2.1: `--num-images` reaches the pipeline as `num_videos_per_prompt`, each video is one animated PNG of
    all its frames; a video whose frames hold NaN is not written (an older file at its path removed) and the command
    exits 1 naming it."""
    import family_folders
    from PIL import Image

    folder = family_folders.wan_folder(tmp_path)
    argv = ["generate", "red apple", "--model", str(folder), "--num-images", "2", "--cache", "on"]
    assert main([*argv, "--out", str(tmp_path / "v.png")]) == 0
    assert "WanPipeline (Wan 2.1 / 2.2)" in capsys.readouterr().out
    for i in range(2):
        with Image.open(tmp_path / f"v-{i}.png") as video:
            assert video.is_animated and video.n_frames == 9 and video.size == (16, 16)

    import dicache.commands.generate as generate_command

    real = generate_command.write_finite_videos

    def spoil_second(frames, paths, fps):
        frames = frames.clone()
        frames[1, 4] = float("nan")  # one frame of the second video
        return real(frames, paths, fps)

    generate_command.write_finite_videos = spoil_second
    try:
        assert main([*argv, "--out", str(tmp_path / "v.png")]) == 1
    finally:
        generate_command.write_finite_videos = real
    err = capsys.readouterr().err
    assert "image 2 of 2: decoded frames" in err and "not written: " + str(tmp_path / "v-1.png") in err
    assert (tmp_path / "v-0.png").is_file() and not (tmp_path / "v-1.png").exists()


def test_a_count_a_pipeline_cannot_take_is_refused_naming_it(tiny_family_folders, tmp_path, capsys, monkeypatch):
    import dicache.commands.generate as generate_command

    monkeypatch.setattr(generate_command, "call_parameters", lambda pipe: {})  # a pipeline with no count parameter
    argv = ["generate", "red apple", "--model", str(tiny_family_folders["flux"]), "--num-images", "3"]
    assert main([*argv, "--out", str(tmp_path / "x.png")]) == 2
    assert "--num-images=3 is refused for FluxPipeline (Flux.1): its pipeline makes one output per prompt" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("family", ["flux", "pixart"])
def test_generate_on_a_family_folder_writes_images_and_prints_stats(
    tiny_family_folders, family, tmp_path, capsys, one_torch_thread
):
    out = tmp_path / "img.png"
    argv = ["generate", "red apple", "blue heart", "--model", str(tiny_family_folders[family]), "--cache", "on"]
    assert main([*argv, "--out", str(out), "--stats-json", str(tmp_path / "s.json")]) == 0
    text = capsys.readouterr().out
    assert (tmp_path / "img-0.png").is_file() and (tmp_path / "img-1.png").is_file()
    name = {"flux": "FluxPipeline (Flux.1)", "pixart": "PixArtSigmaPipeline (PixArt-α / Σ)"}[family]
    assert name in text and "8 steps" in text and "compute fraction" in text
    branches = set(json.loads((tmp_path / "s.json").read_text())["branches"])
    assert branches == ({"cond", "uncond"} if family == "flux" else {"cond"})  # true CFG: two calls; PixArt: batched


def test_calibrate_writes_a_profile_that_generate_uses(
    tiny_family_folders, tmp_path, capsys, monkeypatch, one_torch_thread
):
    candidates = tmp_path / "candidates.json"
    candidates.write_text(json.dumps(FAST))
    profile = tmp_path / "flux.json"
    argv = [
        "calibrate",
        "--model",
        str(tiny_family_folders["flux"]),
        "--prompts",
        "1",
        "--no-step-masks",
        "--no-progress",
    ]
    argv += ["--candidates", str(candidates), "--target-psnr", "20", "--out", str(profile)]
    assert main(argv) == 0
    written = json.loads(profile.read_text())
    assert written["calibration"]["steps"] == 8 and written["calibration"]["guidance_scale"] == 2.0
    achieved = written["calibration"]["achieved"]["compute_fraction"]
    assert achieved < 1.0
    capsys.readouterr()
    monkeypatch.setenv("SGLANG_CACHE_DIT_PROFILE", str(profile))
    stats = tmp_path / "stats.json"
    argv = ["generate", "red apple", "--model", str(tiny_family_folders["flux"]), "--out", str(tmp_path / "p.png")]
    assert main([*argv, "--stats-json", str(stats)]) == 0
    assert f"profile {profile}" in capsys.readouterr().out
    record = json.loads(stats.read_text())
    assert record["config"]["profile"] == str(profile) and record["compute_fraction"] == pytest.approx(achieved)


def test_calibrate_from_python_returns_a_profile_enable_takes(tiny_family_folders, one_torch_thread):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_family_folders["flux"])  # built by the user, plainly; no dicache.json
    pipe.set_progress_bar_config(disable=True)
    profile = dicache.calibrate(
        pipe,
        ["red apple"],
        target_psnr=20,
        steps=8,
        guidance=2.0,
        height=16,
        width=16,
        candidates=FAST,
        step_masks=False,
    )
    assert isinstance(profile, dicache.Profile) and not dicache.is_enabled(pipe)  # left as it was
    dicache.enable(pipe, profile)
    pipe(
        "red apple",
        negative_prompt="",
        true_cfg_scale=2.0,
        num_inference_steps=8,
        height=16,
        width=16,  # the pipeline's default max_sequence_length, as calibrated (no dicache.json from Python)
        generator=torch.Generator().manual_seed(0),
    )
    achieved = profile.calibration["achieved"]["compute_fraction"]
    assert dicache.stats(pipe).compute_fraction == pytest.approx(achieved)


def test_sweep_runs_ours_fewer_steps_and_cache_dit_on_one_family_pipeline(
    tiny_family_folders, tmp_path, one_torch_thread
):
    pytest.importorskip("cache_dit")
    out = tmp_path / "sweep"
    argv = ["sweep", "--model", str(tiny_family_folders["flux"]), "--prompt", "red apple", "--RDT", "0.3", "--W", "1"]
    argv += ["--compute-targets", "0.5", "--reference-steps", "0", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["family"] == "FluxPipeline (Flux.1)"
    assert [s["name"] for s in results["meta"]["schedules"]] == ["8 steps, CFG 2"]  # its dicache.json's schedule
    methods = {r["method"] for r in results["records"]}
    assert methods == {"uncached", "ours", "cache-dit", "fewer-steps"}
    assert [r["pipeline"] for r in results["records"] if r["method"] == "uncached"] == ["native"]  # shared refs
    ours = next(r for r in results["records"] if r["method"] == "ours")
    theirs = next(r for r in results["records"] if r["method"] == "cache-dit")
    assert ours["compute_fraction"] < 1 and abs(ours["psnr"] - theirs["psnr"]) < 0.5  # the same settings agree
    fewer = [r for r in results["records"] if r["method"] == "fewer-steps"]
    assert {r["steps"] for r in fewer} >= {4}  # Euler at 4 of 8 steps: the 0.5 target
    assert "**This model is a diffusers pipeline, FluxPipeline (Flux.1)**" in (out / "report.md").read_text()


def test_a_sweep_from_python_on_a_batched_cfg_family(tiny_family_folders, tmp_path, one_torch_thread):
    from diffusers import DiffusionPipeline

    from dicache.sweep.launch import run_sweep
    from dicache.sweep.spec import Schedule, SweepSpec, expand_grid

    pipe = DiffusionPipeline.from_pretrained(tiny_family_folders["pixart"])
    spec = SweepSpec(
        samples=[("red apple", 0)],
        schedules=[Schedule(8, 4.5)],
        cells=expand_grid({"RDT": [0.3], "W": [1]}),
        methods=("ours",),
        height=16,
        width=16,
        baselines=("euler",),
        reference_steps=None,
        compute_targets=(0.5,),
    )
    call = {"max_sequence_length": 8, "clean_caption": False, "use_resolution_binning": False}
    results = run_sweep(spec, tmp_path, pipe=pipe, call=call, progress=False, log=lambda _: None)
    ours = next(r for r in results["records"] if r["method"] == "ours")
    (sample,) = ours["samples"]
    assert sample["calls"] == 8 and set(sample["cached_steps"]) == {"cond"}  # one batched call a step: both branches
    fewer = next(r for r in results["records"] if r["method"] == "fewer-steps" and r["steps"] == 4)
    assert fewer["compute_fraction"] == pytest.approx(0.5)  # counted against the batched uncached run


def test_settings_a_family_cannot_take_are_refused_before_any_run_naming_setting_and_family(
    tiny_family_folders, tmp_path, capsys, monkeypatch
):
    from diffusers import DiffusionPipeline, HeunDiscreteScheduler

    from dicache.sweep.launch import run_sweep
    from dicache.sweep.spec import Schedule, SweepSpec, SweepSpecError, expand_grid

    flux = str(tiny_family_folders["flux"])
    assert main(["sweep", "--model", flux, "--prompt", "x", "--baselines", "heun", "--out", str(tmp_path)]) == 2
    assert "baselines heun are refused for" in capsys.readouterr().err
    assert main(["generate", "x", "--model", flux, "--embedded-guidance", "3.5", "--out", str(tmp_path / "a.png")]) == 2
    assert "embedded_guidance=3.5 is refused for FluxPipeline (Flux.1)" in capsys.readouterr().err
    assert main(["generate", "x", "--model", flux, "--variant", "turbo", "--out", str(tmp_path / "b.png")]) == 2
    assert "--variant='turbo' is refused for FluxPipeline" in capsys.readouterr().err

    pipe = DiffusionPipeline.from_pretrained(tiny_family_folders["pixart"])
    pipe.scheduler = HeunDiscreteScheduler.from_config(pipe.scheduler.config)

    @functools.wraps(type(pipe).__call__)  # the same signature: how the guidance is passed is read from it
    def no_run(*args, **kwargs):
        pytest.fail("a run started before the refusal")

    monkeypatch.setattr(type(pipe), "__call__", no_run)
    spec = SweepSpec(
        samples=[("x", 0)],
        schedules=[Schedule(8, 4.5)],
        cells=expand_grid({"SCM": ["fast"], "SCM_POLICY": ["static"], "W": [0]}),
        methods=("ours",),
        baselines=("euler",),
        reference_steps=None,
    )
    with pytest.raises(SweepSpecError) as refused:
        run_sweep(spec, tmp_path / "heun", pipe=pipe, progress=False, log=lambda _: None)
    assert "a step mask is refused for PixArtSigmaPipeline (PixArt-α / Σ)" in str(refused.value)
    assert "HeunDiscreteScheduler evaluates the model 2 times per step" in str(refused.value)
    spec.cells = expand_grid({"RDT": [0.2]})
    spec.schedules = [Schedule(8, 1.0, embedded_guidance=3.0)]
    with pytest.raises(SweepSpecError, match=r"embedded_guidance=3 is refused for PixArtSigmaPipeline"):
        run_sweep(spec, tmp_path / "g", pipe=pipe, progress=False, log=lambda _: None)


def test_an_uncached_hub_id_offline_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert main(["generate", "x", "--model", "someone/not-cached-flux", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "someone/not-cached-flux" in err and "offline" in err and "hf download" in err


@pytest.mark.skipif(not (TRAINED_FLUX / "model_index.json").is_file(), reason="the trained Flux is not checked in yet")
def test_the_trained_flux_runs_through_generate_and_a_sweep(tmp_path, capsys, one_torch_thread):
    assert main(["generate", "red apple", "--model", str(TRAINED_FLUX), "--cache", "on", "--steps", "8"]) == 0
    assert "FluxPipeline (Flux.1)" in capsys.readouterr().out
    out = tmp_path / "sweep"
    argv = ["sweep", "--model", str(TRAINED_FLUX), "--num-prompts", "1", "--schedules", "8:4.5", "--RDT", "0.2"]
    argv += ["--compute-targets", "0.5", "--reference-steps", "0", "--methods", "ours", "--no-progress"]
    assert main([*argv, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["measured_on"] == "image"  # a trained VAE: fidelity on the decoded images


def test_calibrate_grid_out_picks_the_best_candidate_per_compute_bin():
    """`--grid-out`: per budget bin [f − 0.05, f + 0.05), the complete candidate with the best criterion PSNR on the
    calibration's prompts; a list value is wrapped so the sweep's grid does not expand it; empty bins are said."""
    from dicache.tuning import budget_grid
    from dicache.tuning.search import Calibration, CandidateResult

    def candidate(index, overrides, compute, psnrs, status="complete"):
        result = CandidateResult(index, overrides, status=status)
        result.psnr = dict(enumerate(psnrs))
        result.blocks_run = {i: round(compute * 100) for i in range(len(psnrs))}
        result.blocks_total = {i: 100 for i in range(len(psnrs))}
        return result

    candidates = [
        candidate(0, {"residual_diff_threshold": 0.1}, 0.30, [40.0, 30.0]),  # min 30
        candidate(1, {"scm_compute_bins": [1, 1], "scm_cache_bins": [2, 2]}, 0.33, [33.0, 32.0]),  # min 32: best
        candidate(2, {"residual_diff_threshold": 0.2}, 0.31, [50.0], status="stopped"),  # incomplete: never chosen
        candidate(3, {"residual_diff_threshold": 0.3}, 0.36, [45.0, 45.0]),  # in the 0.4 bin
    ]
    calibration = Calibration([("a", 0), ("b", 1)], 35.0, "min", [100, 100], 1.0, candidates, None)
    grid, lines = budget_grid(calibration, [0.3, 0.4, 0.5], [{"RDT": [0.1]}])
    assert grid["grid"] == [
        {"scm_compute_bins": [[1, 1]], "scm_cache_bins": [[2, 2]]},
        {"residual_diff_threshold": [0.3]},
    ]
    assert grid["compute_targets"] == [0.3, 0.4, 0.5] and grid["cachedit_grid"] == [{"RDT": [0.1]}]
    assert (
        lines[0].startswith("budget 0.3: #1")
        and lines[2] == "budget 0.5: no complete candidate with compute in its bin"
    )
    from dicache.sweep.spec import expand_grid

    assert [c.overrides for c in expand_grid(grid["grid"])][0]["scm_compute_bins"] == [1, 1]
