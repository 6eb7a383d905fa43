"""The sweep's same-compute baselines: Euler / Heun / curved samplers (toy ODEs and a tiny native pipeline), their
compute accounting next to whole-step reuse, and the dicache-vs-baselines comparison (bins, rules, targets)."""

import math

import pytest
import torch

from dicache.engine.stats import RequestStats
from dicache.models.krea2.pipeline import Krea2Pipeline
from dicache.models.krea2.tiny import random_tiny_transformer, tiny_transformer_config
from dicache.sweep import compare, solvers
from dicache.sweep.flops import CallFlops, flops_ratio
from dicache.sweep.runners import Sample, block_fraction

# ---------------------------------------------------------------------------------------------------- toy ODEs


def _order(errors, steps):
    return math.log(errors[0] / errors[-1]) / math.log(steps[-1] / steps[0])


def test_heun_is_exact_on_a_velocity_linear_in_sigma_where_euler_is_not():
    a, b = torch.tensor([0.3, -1.0]), torch.tensor([2.0, 0.5])
    sigmas = [1.0, 0.8, 0.45, 0.2]  # ends above 0: every step is a full Heun step
    exact = torch.zeros(2) + a * (0.2 - 1.0) + b * (0.2**2 - 1.0) / 2  # x(σ) = ∫ (a + bσ) dσ from x(1) = 0

    def velocity(x, j):
        return a + b * sigmas[j]

    x, evals = solvers.heun(velocity, torch.zeros(2), sigmas)
    assert evals == 2 * 3 and torch.allclose(x, exact, atol=1e-6)
    x, evals = solvers.euler(velocity, torch.zeros(2), sigmas)
    assert evals == 3 and (x - exact).abs().max() > 0.05
    # the step to σ = 0 is a plain Euler step: one evaluation, never at σ = 0
    seen = []
    x, evals = solvers.heun(lambda x, j: seen.append(j) or velocity(x, j), torch.zeros(2), [*sigmas, 0.0])
    assert evals == 2 * 3 + 1 and seen.count(4) == 0 and seen[-1] == 3


def test_heun_converges_at_second_order_and_euler_at_first():
    lam = -1.7  # dx/dσ = λx on σ from 1 to 0.25

    def run(method, n):
        sigmas = torch.linspace(1.0, 0.25, n + 1).tolist()
        x, _ = method(lambda x, j: lam * x, torch.ones(1, dtype=torch.float64), sigmas)
        return abs(float(x) - math.exp(lam * (0.25 - 1.0)))

    steps = [8, 16, 32]
    assert _order([run(solvers.heun, n) for n in steps], steps) == pytest.approx(2.0, abs=0.1)
    assert _order([run(solvers.euler, n) for n in steps], steps) == pytest.approx(1.0, abs=0.1)


def test_reuse_evaluates_only_the_computed_steps():
    sigmas = [1.0, 0.75, 0.5, 0.25, 0.0]
    calls = []

    def velocity(x, j):
        calls.append(j)
        return x + sigmas[j]

    x0 = torch.tensor([1.0])
    assert torch.equal(solvers.reuse(velocity, x0, sigmas, range(4))[0], solvers.euler(velocity, x0, sigmas)[0])
    calls.clear()
    x, evals = solvers.reuse(velocity, x0, sigmas, [0, 2])
    assert calls == [0, 2] and evals == 2
    v0 = x0 + 1.0
    x1 = x0 - 0.5 * v0  # steps 0 and 1 with v(0)
    assert torch.allclose(x, x1 - 0.5 * (x1 + 0.5))  # steps 2 and 3 with v(2)
    with pytest.raises(ValueError, match="must include step 0"):
        solvers.reuse(velocity, x0, sigmas, [1, 2])


def test_curved_schedule_and_counts_per_compute_target():
    assert solvers.curved_steps(28, 10) == [0, 1, 3, 5, 8, 11, 15, 19, 23, 27]  # round((j/9)^1.5 · 27)
    assert solvers.curved_steps(8, 1) == [0] and solvers.curved_steps(8, 9) == list(range(8))
    assert len(solvers.curved_steps(28, 16)) == 15  # (1/15)^1.5·27 and (0/15) both round to 0: deduplicated
    assert solvers.compute_fraction("curved", 28, 16) == 15 / 28
    # Euler: the counts just below and above 0.3 × 28 = 8.4 evaluations; exactly on target: one count
    assert solvers.counts_for("euler", 28, 0.3) == [8, 9] and solvers.counts_for("euler", 28, 0.5) == [14]
    # Heun: 2m − 1 evaluations, 14 → 13 (7 steps) and 15 (8 steps)
    assert solvers.counts_for("heun", 28, 0.5) == [7, 8]
    assert [solvers.compute_fraction("heun", 28, m) for m in (7, 8)] == [13 / 28, 15 / 28]
    # curved: k with the wanted number of distinct computed steps (the smallest such k)
    for n, f in ((8, 0.6), (28, 0.8), (50, 0.3)):
        counts = solvers.counts_for("curved", n, f)
        evals = [solvers.evaluations("curved", n, k) for k in counts]
        assert min(evals) <= f * n <= max(evals) and max(evals) - min(evals) <= 1
    assert solvers.setting_label("heun", 28, 7) == "Heun 7 steps (13 evals)"
    assert solvers.setting_label("curved", 28, 16) == "curved 15 of 28 steps"


# ---------------------------------------------------------------------------------------------------- a tiny pipeline

CONFIG = tiny_transformer_config(num_layers=2)
SIZE = 64  # no VAE: 16 px per token side, 16 image tokens


class FakeTextEncoder:
    """Deterministic random text states per prompt (its length seeds them); the empty prompt is the negative."""

    def encode(self, prompts):
        states = [torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(len(p))) for p in prompts]
        return torch.stack(states), torch.ones(len(prompts), 6, dtype=torch.bool)


@pytest.fixture(scope="module")
def pipe():
    """A random 2-block native pipeline whose time embedding keeps only the slow sinusoids (≤ 3 rad per unit of
    flow time), so that the velocity is smooth in σ: a random model's fast sinusoids add a small ripple that keeps
    any solver out of its asymptotic regime at affordable step counts."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    model = random_tiny_transformer(CONFIG)
    with torch.no_grad():
        half = model.time_embed.embed_dim // 2
        fast = [k for k in range(half) if 1000 * math.exp(-k * math.log(1e4) / half) > 3]
        model.time_embed.linear_1.weight[:, fast] = 0
        model.time_embed.linear_1.weight[:, [half + k for k in fast]] = 0
    pipeline = Krea2Pipeline(transformer=model, text_encoder=FakeTextEncoder())
    pipeline.set_progress_bar_config(disable=True)
    yield pipeline
    torch.set_num_threads(previous)


def _sample(pipe, kind, count, n=None, scale=1.0):
    return solvers.sample(
        pipe, "a red apple", 3, kind=kind, n=n or count, count=count, guidance_scale=scale, height=SIZE, width=SIZE
    )


def test_euler_sampler_reproduces_the_pipeline_bitwise(pipe):
    for scale in (1.0, 2.5):
        out = pipe(
            "a red apple",
            height=SIZE,
            width=SIZE,
            num_inference_steps=5,
            guidance_scale=scale,
            seed=3,
            output_type="latent",
        )
        run = _sample(pipe, "euler", 5, scale=scale)
        assert torch.equal(run.latents, out.latents)
        assert (run.evaluations, run.forwards) == (5, 5 * (2 if scale > 1 else 1))


def test_heun_and_curved_evaluate_guided_velocities_at_the_pipeline_sigmas(pipe, monkeypatch):
    calls = []
    forward = pipe.transformer.forward

    def spy(hidden, text, timestep, positions, *args, **kwargs):
        calls.append((round(float(timestep[0]), 6), id(text)))
        return forward(hidden, text, timestep, positions, *args, **kwargs)

    monkeypatch.setattr(pipe.transformer, "forward", spy)
    rows, cols = pipe.latent_grid(SIZE, SIZE)
    t = [round(float(v), 6) for v in pipe.scheduler.model_timesteps(pipe.sigmas(3, rows * cols, "raw"))]
    run = _sample(pipe, "heun", 3, scale=2.5)
    assert (run.evaluations, run.forwards) == (5, 10)
    assert [c[0] for c in calls] == [x for x in (t[0], t[1], t[1], t[2], t[2]) for _ in range(2)]
    assert calls[0][1] != calls[1][1] and len({c[1] for c in calls}) == 2  # cond then uncond at every evaluation
    calls.clear()
    t = [round(float(v), 6) for v in pipe.scheduler.model_timesteps(pipe.sigmas(12, rows * cols, "raw"))]
    run = _sample(pipe, "curved", 5, n=12, scale=2.5)
    computed = solvers.curved_steps(12, 5)
    assert run.evaluations == len(computed) == 5 and run.forwards == 10
    assert [c[0] for c in calls[::2]] == [t[i] for i in computed]


def test_heun_converges_toward_the_fine_reference_faster_than_euler(pipe):
    fine = _sample(pipe, "heun", 64).latents

    def error(kind, m):
        return float((_sample(pipe, kind, m).latents - fine).norm() / fine.norm())

    steps = [4, 8, 16]
    heun, euler = [error("heun", m) for m in steps], [error("euler", m) for m in steps]
    assert all(h < e for h, e in zip(heun, euler))
    assert _order(heun, steps) > 1.6 and _order(euler, steps) < 1.2  # second vs first order, on the real model


# ---------------------------------------------------------------------------------------------------- accounting


def test_whole_step_reuse_counts_only_the_blocks_that_ran():
    """Fn = 0 (a cached step runs no block) on 28 steps with CFG, computing the curved schedule's 10 steps, costs
    exactly what the curved baseline with k = 10 costs, in blocks and in estimated FLOPs."""
    n, blocks = 28, 10
    computed = solvers.curved_steps(n, 10)
    stats = RequestStats(num_blocks=blocks, fn_blocks=0, bn_blocks=0)
    for branch in ("cond", "uncond"):
        for step in range(n):
            stats.branch(branch).record(step, step not in computed, "test", None)
    assert stats.blocks_run == 2 * len(computed) * blocks
    full = 2 * n
    sample = Sample(
        image=torch.zeros(3, 4, 4),
        latents=torch.zeros(4, 4),
        denoise_s=0.0,
        total_s=0.0,
        calls=2 * len(computed),  # a whole-step reuse need not even call the transformer
        cached_calls=stats.cached_calls,
        blocks_run=stats.blocks_run,
        num_blocks=blocks,
        image_tokens=16,
        text_tokens=8,
        full_calls=full,
    )
    assert sample.compute_fraction == solvers.compute_fraction("curved", n, 10) == len(computed) / n
    assert block_fraction(0, blocks, full) == 0.0 and block_fraction(0, blocks, 0) == 1.0
    call = CallFlops(per_block=5.0, fixed=2.0, text=3.0, num_blocks=blocks)
    cached = flops_ratio(call, sample.calls, sample.blocks_run, 2, full, 2)
    expected = (2 * len(computed) * (blocks * 5.0 + 2.0) + 2 * 3.0) / (full * (blocks * 5.0 + 2.0) + 2 * 3.0)
    assert cached == pytest.approx(expected)
    # the same cached steps when the transformer is still called (embeddings run, no block): fixed part counted
    called = flops_ratio(call, full, sample.blocks_run, 2, full, 2)
    assert called > cached and flops_ratio(call, full, full * blocks, 2) == 1.0


class FakeVAE:
    """Decodes by upsampling the first 3 latent channels: enough for `NativeRunner`'s images."""

    scale_factor = 8
    dtype = torch.float32

    def decode(self, latents):
        return torch.nn.functional.interpolate(latents[:, :3], scale_factor=8)


def test_whole_step_reuse_in_the_engine_costs_what_the_curved_baseline_costs(pipe, monkeypatch):
    from dicache.sweep.runners import NativeRunner
    from dicache.sweep.spec import Schedule, make_cell

    monkeypatch.setattr(pipe, "vae", FakeVAE())
    runner = NativeRunner(pipe)
    schedule = Schedule(12, 2.5)
    settings = {"Fn": 0, "SCM": "curved", "scm_compute_fraction": 5 / 12, "scm_curve": 1.5, "SCM_POLICY": "static"}
    cell = make_cell({**settings, "W": 0})
    cached = runner.generate("a red apple", 3, schedule, 12, SIZE, SIZE, cell.config)
    computed = sorted(set(range(12)) - set(cached.cached_steps["cond"]))
    assert computed == solvers.curved_steps(12, 5) and cached.cached_steps["uncond"] == cached.cached_steps["cond"]
    assert cached.blocks_run == 2 * 5 * CONFIG["num_layers"] and cached.calls == 24  # cached calls run no block
    baseline = runner.generate_baseline("a red apple", 3, schedule, "curved", 5, SIZE, SIZE)
    assert baseline.calls == 10 and cached.compute_fraction == baseline.compute_fraction == 5 / 12


# ---------------------------------------------------------------------------------------------------- comparison


def _r(method, c, p, p_ref=None, setting=None):
    return {
        "method": method,
        "compute_fraction": c,
        "psnr": p,
        "psnr_ref": p_ref,
        "setting": setting or f"{method}@{c}",
    }


def test_baseline_curves_interpolate_and_the_conservative_rule():
    pts = compare.curve([_r("heun", 0.3, 20.0), _r("heun", 0.5, 30.0), _r("heun", 0.4, 19.0)], "psnr")
    assert pts == [(0.3, 20.0), (0.5, 30.0)]  # 0.4 at 19 dB is dominated
    assert compare.value_at(pts, 0.45) == (pytest.approx(27.5), "interpolated")
    assert compare.value_at(pts, 0.5) == (30.0, "exact")
    assert compare.value_at(pts, 0.2) == (None, "not reached")  # its cheapest run costs 0.3: no value at 0.2
    assert compare.value_at(pts, 0.298) == (20.0, "exact")  # within the stated rounding tolerance
    assert compare.value_at(pts, 0.6) == (30.0, "extrapolated")
    assert compare.value_at(pts, 0.45, "at_least") == (30.0, "at_least")
    assert compare.value_at(pts, 0.6, "at_least") is None
    assert compare.curve([_r("curved", 1.0, 100.0)], "psnr") == []  # identical to the reference: no value


def test_bins_pick_the_largest_margin_and_targets_are_judged_per_measure():
    groups = {
        "fewer-steps": [_r("fewer-steps", c, 20 + 20 * c, 18 + 10 * c) for c in (0.25, 0.5, 0.75, 0.875)],
        "heun": [_r("heun", 0.3, 10.0, 30.0), _r("heun", 0.9, 11.0, 31.0)],
        "curved": [],
        "cache-dit": [],
    }
    ours = [
        _r("ours", 0.30, 33.0, 25.0, "a"),  # Euler at 0.3: 26 dB → +7 (ref: heun 30 → −5)
        _r("ours", 0.34, 33.5, 26.0, "b"),  # Euler at 0.34: 26.8 → +6.7
        _r("ours", 0.52, 32.0, 27.0, "c"),  # bins are [f − 0.05, f + 0.05): this one is in 0.5
    ]
    rows = {r["bin"]: r for r in compare.bin_rows(ours, groups, "psnr", [0.3, 0.5, 0.8])}
    assert rows[0.3]["ours"]["setting"] == "a" and rows[0.3]["margin"] == pytest.approx(7.0)
    assert rows[0.3]["best"] == "fewer-steps" and rows[0.3]["baselines"]["heun"]["value"] == 10.0
    assert rows[0.3]["margin_at_least"] == pytest.approx(33.0 - 30.0)  # Euler's cheapest point ≥ 0.3: 0.5 → 30 dB
    assert rows[0.5]["ours"]["setting"] == "c" and rows[0.5]["margin"] == pytest.approx(32.0 - 30.4)
    assert rows[0.8]["ours"] is None and rows[0.8]["margin"] is None and rows[0.8]["compute"] == 0.8
    check = compare.target_check(28, ours, groups, "psnr")
    assert check["kind"] == "margin" and not check["met"] and check["failed"] == [0.4, 0.6, 0.7, 0.8]
    ref = compare.target_check(28, ours, groups, "psnr_ref")["rows"][0]
    # on the other measure Heun is the best baseline and "b" has the larger margin: 26 − (30 + 0.04/0.6)
    assert ref["best"] == "heun" and ref["ours"]["setting"] == "b" and ref["margin"] == pytest.approx(-4.0667, abs=1e-4)
    few = compare.target_check(8, [_r("ours", 0.55, 35.2), _r("ours", 0.7, 40.0)], groups, "psnr")
    assert few["kind"] == "quality" and few["met"] and few["best"]["compute_fraction"] == 0.55
    assert not compare.target_check(8, [_r("ours", 0.55, 34.9)], groups, "psnr")["met"]
    assert compare.target_check(6, ours, groups, "psnr") is None


# ---------------------------------------------------------------------------------------------------- spec and CLI


def test_baselines_and_reference_steps_in_the_cli_and_grid_files(tmp_path, monkeypatch, capsys):
    import pathlib
    import sys

    from dicache.commands.sweep import main

    monkeypatch.setitem(sys.modules, "cache_dit", None)  # not installed (and not slow to import): skipped, said so
    policies = pathlib.Path(__file__).parents[1] / "benchmarks" / "grids" / "sweep_policies.yaml"
    assert main(["--grid", str(policies), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "samples (16)" in out and "size: 128 x 128 px" in out and "reference: 200-step Euler" in out
    assert "baselines: euler, heun, curved at compute 0.3, 0.4, 0.5, 0.6, 0.7, 0.8" in out
    assert "the cache-dit baseline is skipped" in out

    argv = ["--prompt", "x", "--dry-run", "--baselines", "curved", "cachedit", "--reference-steps", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "the cache-dit baseline is skipped" in out and 'pip install "dicache[bench]"' in out
    assert "methods: ours + fewer steps" in out and "baselines: curved at" in out and "reference: off" in out
    assert main(["--prompt", "x", "--dry-run", "--baselines", "rk4"]) == 2
    assert "baseline 'rk4' is unknown; allowed: euler, heun, curved, cachedit" in capsys.readouterr().err
    grid = tmp_path / "g.json"
    grid.write_text('{"grid": {"RDT": [0.1]}, "compute_targets": [0.5, 1.5]}')
    assert main(["--prompt", "x", "--dry-run", "--grid", str(grid)]) == 2
    assert "compute_targets value 1.5 is invalid: must be a number in (0, 1]" in capsys.readouterr().err


def test_the_high_accuracy_reference_is_shared_by_step_counts(tmp_path):
    from types import SimpleNamespace

    from dicache.sweep.run import Sweep
    from dicache.sweep.spec import Schedule, SweepSpec, make_cell

    spec = SweepSpec(samples=[("x", 0)], schedules=[Schedule(28, 4.5)], cells=[make_cell({})], methods=("ours",))
    native = SimpleNamespace(num_blocks=10, default_size=(128, 128))
    sweep = Sweep(spec, tmp_path, native, progress=False, log=lambda _: None)
    key = sweep.hiref_key
    assert key(Schedule(28, 4.5), "x", 0) == key(Schedule(50, 4.5), "x", 0) != key(Schedule(8), "x", 0)
    assert key(Schedule(28, 4.5), "x", 0) != key(Schedule(28, 4.5, "turbo"), "x", 0)  # another sigma schedule
    runs = sweep._solver_runs(Schedule(28, 4.5))
    assert ("heun", 7) in runs and ("heun", 8) in runs and ("curved", 14) in runs
    assert sweep._euler_targets(Schedule(28, 4.5)) == [8, 9, 11, 12, 14, 16, 17, 19, 20, 22, 23]


def test_the_report_describes_the_baselines_sigmas_of_a_distilled_model():
    from dicache.sweep.report import baselines_text

    raw, distilled = baselines_text(False), baselines_text(True)
    assert "resolution-aware" in raw and "pinned at 1.15" not in raw
    assert "resolution-aware" not in distilled and "mu pinned at 1.15" in distilled
    assert "every bin 0.5–0.8" in distilled and "every bin 0.5–0.8" not in raw
