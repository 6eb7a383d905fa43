"""Cached-step methods (`cached_step_method`, docs/architecture.md §2): the fitted output predictor's maths, its file,
its settings and its path through the hook layer, by hand on a toy stack; its fit through the engine on the tiny
Krea-2 pipeline."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from toymodels import LinearInTimeBlock, SeamTransformer, timesteps

import dicache
from dicache import CacheConfig, ConfigError
from dicache.engine.cached_step import (
    FITTER,
    ComputedCalls,
    FittedWeights,
    feature_width,
    load_weights,
    sample_weights,
    solve_ridge,
    steering_target,
)
from dicache.settings.cache_config import PROFILE_ENV

MASK = (1, 1, 0, 1, 0)  # steps 2 and 4 predicted
DIM = 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread is faster on a busy CPU


def fitted_config(**extra) -> CacheConfig:
    return CacheConfig.from_env(
        {},
        scm_compute_bins=[2, 1],
        scm_cache_bins=[1, 1],
        scm_policy="static",
        max_warmup_steps=0,
        Fn_compute_blocks=0,
        cached_step_method="fitted",
        **extra,
    )


def blocks_of(*parts: tuple[int, torch.Tensor]) -> torch.Tensor:
    """A `(5·DIM + 1, DIM)` weight built from (feature index, DIM × DIM matrix) parts; index 5 is the bias row."""
    w = torch.zeros(feature_width(DIM), DIM)
    for index, part in parts:
        if index == 5:
            w[5 * DIM] = part
        else:
            w[index * DIM : (index + 1) * DIM] = part
    return w


EYE = torch.eye(DIM)
# step 2: 2·v0 − v1 + 0.5·(x − x0) + 0.1; step 4: v0 + v2 (v2: the oldest of the three computed calls kept)
W2 = blocks_of((0, 2 * EYE), (1, -EYE), (3, 0.5 * EYE), (4, -0.5 * EYE), (5, torch.full((DIM,), 0.1)))
W4 = blocks_of((0, EYE), (2, EYE))


class CountingBlock(LinearInTimeBlock):
    calls = 0

    def forward(self, hidden_states, temb):
        CountingBlock.calls += 1
        return super().forward(hidden_states, temb)


def drive(model, x, num_steps):
    """The toy sampler, one call a step: `x ← x − 0.05·out`; every call's input and output."""
    seen = []
    with torch.no_grad():
        for t in timesteps(num_steps):
            out = model(x, torch.tensor([t]))
            seen.append((x, out))
            x = x - 0.05 * out
    return seen


def request_run(model) -> None:
    with dicache.request(model, num_inference_steps=5):
        drive(model, torch.randn(1, 2, DIM), 5)


# ------------------------------------------------------------------------------------------------------ pure maths
def test_features_are_the_last_computed_calls_and_this_input_by_hand():
    calls = ComputedCalls()
    xs = [torch.full((1, 2, 3), float(k)) for k in range(4)]
    vs = [torch.full((1, 2, 3), 10.0 + k) for k in range(4)]
    calls.record(xs[0], vs[0])
    x = torch.full((1, 2, 3), 7.0)
    # one computed call: it stands in for v1 and v2
    assert calls.features(x)[0, 0].tolist() == [10.0] * 9 + [7.0] * 3 + [0.0] * 3 + [1.0]
    for k in (1, 2, 3):
        calls.record(xs[k], vs[k])
    # four recorded, three kept: v0 = the newest (13), v1 = 12, v2 = 11; x0 = the newest input (3)
    assert calls.features(x)[0, 1].tolist() == [13.0] * 3 + [12.0] * 3 + [11.0] * 3 + [7.0] * 3 + [3.0] * 3 + [1.0]
    assert feature_width(3) == 16


def test_ridge_recovers_a_linear_map_and_the_steering_target_returns_to_the_reference():
    torch.manual_seed(0)
    w = torch.randn(6, 4)
    xs = [torch.randn(2, 50, 6), torch.randn(1, 30, 6)]
    assert torch.allclose(solve_ridge(xs, [x @ w for x in xs], 1e-12), w, atol=1e-5)
    shrunk = solve_ridge(xs, [x @ w for x in xs], 10.0)  # a strong ridge shrinks towards 0
    assert shrunk.norm() < 0.5 * w.norm()
    # one Euler step of size dt with the target lands on the reference's next latent: x + dt·v = x_ref + dt·v_ref
    x, x_ref, v_ref, dt = torch.randn(1, 5, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 4), -0.2
    torch.testing.assert_close(x + dt * steering_target(v_ref, x_ref, x, dt), x_ref + dt * v_ref)
    with pytest.raises(ValueError, match="dt"):
        steering_target(v_ref, x_ref, x, 0.0)


def test_weighted_rows_and_the_sample_weights_by_hand():
    torch.manual_seed(0)
    w1, w2 = torch.randn(5, 3), torch.randn(5, 3)
    x = torch.randn(2, 40, 5)
    y = torch.stack([x[0] @ w1, x[1] @ w2])  # sample 0 follows w1, sample 1 w2
    only_first = solve_ridge([x], [y], 1e-12, [torch.tensor([[1.0], [0.0]])])  # (B, 1): per sample
    assert torch.allclose(only_first, w1, atol=1e-5)
    # a weight of 2 counts the rows twice
    twice = solve_ridge([torch.cat([x[:1], x[:1], x[1:]])], [torch.cat([y[:1], y[:1], y[1:]])], 1e-3)
    assert torch.allclose(solve_ridge([x], [y], 1e-3, [torch.tensor([[2.0], [1.0]])]), twice, atol=1e-5)
    # 1 / (d + floor · mean d), mean 1: d = (1, 3), floor 1 -> 1/3 and 1/5 -> 1.25 and 0.75
    assert sample_weights(torch.tensor([1.0, 3.0]), 1.0).tolist() == pytest.approx([1.25, 0.75])
    assert sample_weights(torch.tensor([0.0, 0.0]), 0.25).tolist() == [1.0, 1.0]  # nothing has moved yet
    assert sample_weights(torch.tensor([1.0, 3.0]), None).tolist() == [1.0, 1.0]


def test_the_fitter_weighs_a_sample_off_the_trajectory_less():
    from dicache.sweep.fitting import Trajectory, TrajectoryFitter

    torch.manual_seed(1)
    ref = {0: torch.randn(2, 30, 4), 1: torch.randn(2, 30, 4)}
    x = ref[0].clone()
    x[1] += 2.0  # sample 1 is 2 off in every entry: d = (0, 4)
    calls = ComputedCalls()
    calls.record(torch.randn(2, 30, 4), torch.randn(2, 30, 4))
    features = calls.features(x)
    trajectory = Trajectory(x=ref, dt=[-0.5])
    target = (ref[1] - x) / -0.5
    fitted = TrajectoryFitter(trajectory, ridge=1e-3, weight_floor=0.25).weights(0, "cond", x, features, {})
    # 1 / (d + 0.25 · 2) = (2, 1/4.5) before the scaling to mean 1 (which changes nothing)
    by_hand = solve_ridge([features], [target], 1e-3, [torch.tensor([[2.0], [1 / 4.5]])])
    torch.testing.assert_close(fitted, by_hand)
    alike = TrajectoryFitter(trajectory, ridge=1e-3, weight_floor=None).weights(0, "cond", x, features, {})
    torch.testing.assert_close(alike, solve_ridge([features], [target], 1e-3))
    assert not torch.allclose(alike, fitted, atol=1e-3)


# ------------------------------------------------------------------------------------------------------ the hook
def test_predicted_calls_run_nothing_and_equal_the_hand_computed_map(tmp_path):
    torch.manual_seed(2)
    model = SeamTransformer(num_blocks=4, dim=DIM, block=CountingBlock).eval()
    x = torch.randn(1, 3, DIM)
    path = FittedWeights(5, MASK, {(2, "cond"): W2, (4, "cond"): W4}).save(tmp_path / "p.safetensors")
    dicache.enable(model, fitted_config(fitted_predictor=str(path)))
    CountingBlock.calls = 0
    try:
        with dicache.request(model, num_inference_steps=5):
            seen = drive(model, x, 5)
        stats = dicache.stats(model)
    finally:
        dicache.disable(model)
    assert CountingBlock.calls == 4 * 3, "only the 3 computed calls run blocks"
    branch = stats.branches["cond"]
    assert branch.computed_steps == [0, 1, 3] and branch.cached_steps == [2, 4]
    assert {branch.reasons[s] for s in (2, 4)} == {"mask"} and stats.compute_fraction == pytest.approx(3 / 5)
    with torch.no_grad():  # computed calls: the plain model at the input they see
        for step in (0, 1, 3):
            torch.testing.assert_close(seen[step][1], model(seen[step][0], torch.tensor([timesteps(5)[step]])))
    (_, v0), (x1, v1), (x2, v2), (_, v3) = seen[0], seen[1], seen[2], seen[3]
    torch.testing.assert_close(v2, 2 * v1 - v0 + 0.5 * (x2 - x1) + 0.1)
    torch.testing.assert_close(seen[4][1], v3 + v0)  # v0: computed calls 3, 1, 0 are kept; 0 is the oldest


def test_a_fitter_is_handed_the_features_and_supplies_the_weights():
    torch.manual_seed(3)
    model = SeamTransformer(num_blocks=3, dim=DIM).eval()
    x = torch.randn(2, 4, DIM)

    class Recording:
        def __init__(self):
            self.calls = []

        def weights(self, step, branch, x, features, calls):
            self.calls.append((step, branch, x, features))
            return W4

    fitter = Recording()
    dicache.enable(model, fitted_config())
    token = FITTER.set(fitter)
    try:
        with dicache.request(model, num_inference_steps=5):
            seen = drive(model, x, 5)
    finally:
        FITTER.reset(token)
        dicache.disable(model)
    assert [(s, b) for s, b, _, _ in fitter.calls] == [(2, "cond"), (4, "cond")]
    step, _, given_x, features = fitter.calls[0]
    assert given_x is seen[2][0]
    ones = torch.ones(2, 4, 1)
    hand = torch.cat([seen[1][1], seen[0][1], seen[0][1], seen[2][0], seen[1][0], ones], dim=-1)
    torch.testing.assert_close(features, hand)


def test_without_a_file_or_a_fitter_a_cached_call_names_the_setting():
    model = SeamTransformer(num_blocks=3, dim=DIM).eval()
    dicache.enable(model, fitted_config())
    try:
        with pytest.raises(ConfigError, match="SGLANG_CACHE_DIT_FITTED_PREDICTOR"):
            request_run(model)
    finally:
        dicache.disable(model)


def test_a_file_fitted_for_another_mask_or_schedule_is_refused(tmp_path):
    model = SeamTransformer(num_blocks=3, dim=DIM).eval()
    other = FittedWeights(5, (1, 0, 1, 1, 0), {(1, "cond"): W4}).save(tmp_path / "other.safetensors")
    dicache.enable(model, fitted_config(fitted_predictor=str(other)))
    try:
        with pytest.raises(ConfigError, match="fitted for 5 steps with the step mask 10110"):
            request_run(model)
    finally:
        dicache.disable(model)
    partial = FittedWeights(5, MASK, {(2, "cond"): W2}).save(tmp_path / "partial.safetensors")
    dicache.enable(model, fitted_config(fitted_predictor=str(partial)))
    try:
        with pytest.raises(ConfigError, match="no weights for step 4, branch 'cond'"):
            request_run(model)
    finally:
        dicache.disable(model)


# ------------------------------------------------------------------------------------------------- file and settings
def test_the_file_round_trips_and_bad_files_name_the_setting(tmp_path):
    fit = FittedWeights(5, MASK, {(2, "cond"): W2, (4, "uncond"): W4}, ridge=0.01, fitted_on=[{"prompt": "a"}])
    loaded = load_weights(fit.save(tmp_path / "f.safetensors"))
    assert (loaded.num_steps, loaded.mask, loaded.ridge, loaded.fitted_on) == (5, MASK, 0.01, [{"prompt": "a"}])
    assert torch.equal(loaded.weight(4, "uncond"), W4) and set(loaded.weights) == {(2, "cond"), (4, "uncond")}
    with pytest.raises(ConfigError, match="FITTED_PREDICTOR.*no such file"):
        load_weights(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        load_weights(junk)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="not a dicache predictor file"):
        load_weights(tmp_path / "plain.safetensors")


def test_a_weight_is_copied_to_a_device_once_per_fit():
    fit = FittedWeights(5, MASK, {(2, "cond"): W2.double()})
    assert fit.weight(2, "cond", "cpu") is fit.weights[(2, "cond")]  # already there: no copy
    on_meta = fit.weight(2, "cond", torch.device("meta"))
    assert on_meta.device.type == "meta" and on_meta.dtype == torch.float32 and on_meta.shape == W2.shape
    assert fit.weight(2, "cond", "meta") is on_meta and len(fit.device_copies) == 1
    with pytest.raises(ConfigError, match="no weights for step 3"):
        fit.weight(3, "cond", "meta")


def test_settings_rules_name_both_settings():
    with pytest.raises(ConfigError, match="static step mask"):
        CacheConfig.from_env({}, cached_step_method="fitted")
    with pytest.raises(ConfigError, match="Fn_compute_blocks=0"):
        fitted_config().merged({"Fn_compute_blocks": 1})
    with pytest.raises(ConfigError, match="read only by cached_step_method='fitted'"):
        CacheConfig.from_env({}, fitted_predictor="p.safetensors")
    env = {"SGLANG_CACHE_DIT_CACHED_STEP_METHOD": "Fitted", "SGLANG_CACHE_DIT_SCM_PRESET": "curved"}
    env |= {
        "SGLANG_CACHE_DIT_SCM_POLICY": "static",
        "SGLANG_CACHE_DIT_FN": "0",
        "SGLANG_CACHE_DIT_FITTED_PREDICTOR": "",
    }
    config = CacheConfig.from_env(env)
    assert config.cached_step_method == "fitted" and config.fitted_predictor is None
    with pytest.raises(ConfigError, match="CACHED_STEP_TOKENS"):
        CacheConfig.from_env({"SGLANG_CACHE_DIT_CACHED_STEP_TOKENS": "1.5"})


def test_a_profile_names_its_predictor_relative_to_itself(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    profile = folder / "turbo.json"
    settings = {**fitted_config().model_dump(exclude_none=True), "fitted_predictor": "turbo.predictors/m.safetensors"}
    profile.write_text(json.dumps({"settings": settings}))
    config = CacheConfig.from_env({PROFILE_ENV: str(profile)})
    assert config.fitted_predictor == str(folder / "turbo.predictors" / "m.safetensors")


# ------------------------------------------------------------------------------------------------------ the fit
@pytest.fixture(scope="module")
def turbo_runner():
    from dicache.models.krea2.checkpoints import resolve_model
    from dicache.sweep.runners import NativeRunner

    return NativeRunner.load(str(resolve_model(None, "turbo")))


FIT_SAMPLES = [("red apple", 7), ("rocket", 8)]


def test_the_fit_steers_each_cached_step_back_to_the_uncached_trajectory(turbo_runner, tmp_path):
    from dicache.sweep.fitting import BatchRun, Trajectory, fit_predictor
    from dicache.sweep.spec import Schedule
    from dicache.tuning.predictor import predictor_overrides

    run = BatchRun(turbo_runner, Schedule(4, 1.0, "turbo"), 32, 32)
    trajectory = Trajectory.record(run, FIT_SAMPLES)
    assert sorted(trajectory.x) == [0, 1, 2, 3, 4] and trajectory.x[0].shape == (2, 16, 64)
    assert len(trajectory.dt) == 4 and all(dt < 0 for dt in trajectory.dt)
    fit = fit_predictor(run, FIT_SAMPLES, predictor_overrides((1, 0, 1, 0)), trajectory)
    assert fit.mask == (1, 0, 1, 0) and set(fit.weights) == {(1, "cond"), (3, "cond")}
    assert fit.weights[(1, "cond")].shape == (feature_width(64), 64)
    reference = run(FIT_SAMPLES, None)
    reuse = FittedWeights(4, (1, 0, 1, 0), {k: blocks_of_width(64) for k in fit.weights})
    errors = {}
    for name, weights in (("fitted", fit), ("reuse", reuse)):
        path = weights.save(tmp_path / f"{name}.safetensors")
        config = CacheConfig.from_env({}, **predictor_overrides((1, 0, 1, 0), str(path)), enable_cache=True)
        errors[name] = float((run(FIT_SAMPLES, config) - reference).norm() / reference.norm())
    assert errors["fitted"] < 0.5 * errors["reuse"], errors


def test_a_sweep_fits_a_quantized_models_predictor_toward_the_unquantized_run(turbo_runner, tmp_path):
    """`ours-int8` (the quantization axis; FP8 needs a GPU, INT8 runs here) fits its predictor on the quantized model,
    steering to the unquantized model's uncached run: the run its samples are measured against, and what `dicache
    calibrate --quantization` fits to. `ours` fits on and to the unquantized model."""
    from dicache.sweep.fitting import BatchRun, Trajectory, fit_predictor, fit_samples
    from dicache.sweep.run import Sweep
    from dicache.sweep.runners import NativeRunner
    from dicache.sweep.spec import Schedule, SweepSpec, expand_grid
    from dicache.tuning.predictor import predictor_overrides

    schedule, mask = Schedule(4, 1.0, "turbo"), (1, 0, 1, 0)
    int8 = NativeRunner.load(str(turbo_runner.pipe.source), quantization="int8")
    cells = expand_grid([{k: [v] for k, v in predictor_overrides(mask).items()}])
    spec = SweepSpec(
        samples=[("dog face", 3)],
        schedules=[schedule],
        cells=cells,
        methods=("ours", "ours-int8"),
        height=32,
        width=32,
        baselines=(),
        reference_steps=None,
        fit_prompts=FIT_SAMPLES[:1],
        fit_seeds=1,
    )
    sweep = Sweep(spec, tmp_path, turbo_runner, quantized={"ours-int8": int8}, progress=False, log=lambda _: None)
    records = {r["method"]: r for r in sweep.run()["records"] if r.get("settings")}
    assert records["ours-int8"]["pipeline"] == "ours-int8" and records["ours-int8"]["psnr"] < 99
    fits = fit_samples(FIT_SAMPLES[:1], 1)

    def fit(model, steered_to):
        trajectory = Trajectory.record(BatchRun(steered_to, schedule, 32, 32), fits)
        return fit_predictor(BatchRun(model, schedule, 32, 32), fits, predictor_overrides(mask), trajectory)

    def saved(method, steered_to=None):
        return load_weights(tmp_path / "predictors" / f"{sweep.predictor_key(method, schedule, cells[0], steered_to)}"
                            ".safetensors")  # fmt: skip

    expected = {
        "ours": (saved("ours"), fit(turbo_runner, turbo_runner)),
        "ours-int8": (saved("ours-int8", "native"), fit(int8, turbo_runner)),
    }
    for method, (got, want) in expected.items():
        assert set(got.weights) == set(want.weights) == {(1, "cond"), (3, "cond")}
        for key in want.weights:
            torch.testing.assert_close(got.weights[key], want.weights[key], msg=f"{method} {key}")
    own = fit(int8, int8)  # steered to the quantized model's own run: another predictor
    assert not torch.allclose(own.weights[(3, "cond")], expected["ours-int8"][0].weights[(3, "cond")])


def blocks_of_width(channels: int) -> torch.Tensor:
    """The reuse map: the newest computed output, unchanged."""
    w = torch.zeros(feature_width(channels), channels)
    w[:channels] = torch.eye(channels)
    return w


def test_calibrate_scores_each_prompt_with_a_fit_that_never_saw_it_and_the_profile_names_the_final_fit(
    turbo_runner, tmp_path
):
    """Each calibration sample is scored with the predictor fitted on the other fold's prompts (its file's
    `fitted_on` holds no sample of its prompt); the chosen candidate's profile names a fit on every prompt, and the
    profile reproduces that run."""
    from dicache.commands.calibrate import _keep_chosen_predictor, predictor_folder
    from dicache.engine.cached_step.weights import load_weights
    from dicache.settings.profiles import write_profile
    from dicache.tuning import PipelineRunner, calibrate, profile_settings
    from dicache.tuning.predictor import PredictorSearch

    runner = PipelineRunner(turbo_runner.pipe, 4, 1.0, "turbo", 32, 32)
    samples = [("dog face", 3), ("red apple", 5)]
    out = tmp_path / "turbo.json"
    search = PredictorSearch(runner, samples, 1, predictor_folder(str(out)))
    result = calibrate(
        runner, samples, [], target_psnr=10.0, criterion="mean", progress=False, step_masks=False, predictor=search
    )
    fitted = [c for c in result.candidates if c.fitted_mask is not None]
    assert search.fits == len(fitted) >= 3 and all(c.status == "complete" for c in fitted)
    for candidate in fitted:
        for i, (prompt, _) in enumerate(samples):
            fit = load_weights(candidate.sample_configs[i].fitted_predictor)
            seen = {row["prompt"] for row in fit.fitted_on}
            assert prompt not in seen and seen, (candidate.label, prompt, seen)  # scored on a prompt it never saw
    chosen = result.chosen
    assert chosen in fitted and chosen.compute_fraction == 0.5  # the beam goes down to 2 computed steps of 4
    final = load_weights(chosen.config.fitted_predictor)
    assert {row["prompt"] for row in final.fitted_on} == {p for p, _ in samples}  # the file to use saw them all
    settings = profile_settings(chosen)
    _keep_chosen_predictor(settings, str(out))
    assert [p.name for p in predictor_folder(str(out)).iterdir()] == [settings["fitted_predictor"].split("/")[1]]
    write_profile(out, settings, {})
    config = CacheConfig.from_env({PROFILE_ENV: str(out)})
    again = runner.run(*samples[0], config)
    direct = runner.run(*samples[0], chosen.config)
    assert torch.equal(again.image, direct.image)  # the profile runs the final fit


def test_the_predictor_search_refuses_one_prompt_naming_why():
    from dicache.tuning import CalibrationError
    from dicache.tuning.predictor import PredictorSearch

    with pytest.raises(CalibrationError, match=r"at least 2 calibration prompts \(got 1\)"):
        PredictorSearch(None, [("dog face", 3)], 2, "unused")


WEIGHTS = (0, 1, 5, 2, 8, 3, 4, 0)


def weighted_score(scored: list) -> Callable:
    """A mask search's score on numbers: the sum of the computed steps' weights `WEIGHTS`; each mask scored is
    appended to `scored`."""

    def score(mask):
        scored.append(mask)
        return float(sum(w for w, f in zip(WEIGHTS, mask) if f))

    return score


def test_long_schedules_climb_from_the_best_curved_mask_cheapest_budget_first():
    from dicache.tuning.masks import computed_steps
    from dicache.tuning.predictor import climb_masks

    scored = []
    score = weighted_score(scored)

    three, four = (1, 1, 0, 0, 0, 0, 1, 0), (1, 1, 1, 0, 0, 1, 0, 0)
    noisy = (1, 0, 1, 0, 0, 0, 1, 0)  # scored 4 with the curved masks (9 if scored again): its score is kept
    curved = {three: 5.0, noisy: 4.0, four: 9.0}
    # 3 steps: from [0, 1, 6] (5), [0, 2, 6] kept at 4, by [0, 3, 6] (6), [0, 5, 6] (7: the scan goes on after the
    # move taken), [0, 4, 5] (11) to [0, 4, 6] (12), a local best short of 13; then 4 steps: from [0, 1, 2, 5] (9)
    # up to [0, 2, 4, 6] (17), climbing on past the target at that compute
    found = climb_masks(curved, score, target=13.0, budget=100)
    assert [m for m, _ in found] == scored and len(set(scored)) == len(scored) and not set(scored) & set(curved)
    accepted = [[0, 3, 6], [0, 5, 6], [0, 4, 5]]
    assert [computed_steps(m) for m, _ in found[:3]] == accepted and computed_steps(found[6][0]) == [0, 4, 6]
    counts = [sum(m) for m, _ in found]
    assert counts == sorted(counts) and counts.count(3) == 7  # cheapest first; [0, 4, 6]'s moves were all scored
    assert max(v for m, v in found if sum(m) == 3) == 12 and max(v for m, v in found if sum(m) == 4) == 17
    # a count that meets the target stops the climb after it; the budget bounds it
    assert {sum(m) for m, _ in climb_masks(curved, score, target=5.0, budget=100)} == {3}
    assert len(climb_masks(curved, score, target=13.0, budget=4)) == 4


def test_short_schedules_search_below_the_cheapest_count_meeting_the_target():
    from dicache.tuning.masks import computed_steps, masks_of
    from dicache.tuning.predictor import search_below_target

    scored = []
    score = weighted_score(scored)

    def mask(*steps):
        return tuple(1 if i in steps else 0 for i in range(8))

    assert len(masks_of(8, 4)) == 35 and masks_of(4, 2) == [(1, 1, 0, 0), (1, 0, 1, 0), (1, 0, 0, 1)]
    # what a beam search left: 5 steps meet 14 dB, the best 4-step mask found (11) does not, nor 3 or 2 steps
    beam = {mask(0, 2, 4, 5, 6): 20.0, mask(0, 2, 3, 6): 11.0, mask(0, 1, 2, 5): 9.0, mask(0, 1, 6): 5.0}
    beam[mask(0, 4)] = 8.0
    found = search_below_target(beam, score, target=14.0, budget=100)
    assert [m for m, _ in found] == scored and len(set(scored)) == len(scored) and not set(scored) & set(beam)
    # every 4-step mask not scored yet (33), nearest [0, 2, 3, 6] first; 17 meets it, so every 3-step one (20);
    # none of those meets it: never 2 steps
    assert [sum(m) for m, _ in found] == [4] * 33 + [3] * 20
    assert all(sum(a != b for a, b in zip(m, mask(0, 2, 3, 6))) == 2 for m, _ in found[:9])
    assert max(v for m, v in found if sum(m) == 4) == 17.0 and max(v for m, v in found if sum(m) == 3) == 13.0
    # a count whose unscored masks do not fit in the budget left is climbed: from [0, 2, 3, 6] (11), step 2 moved
    # by +2 to [0, 3, 4, 6] (14: meets it), the scan going on to [0, 4, 5, 6] (15), a local best
    scored.clear()
    climbed = search_below_target(beam, score, target=14.0, budget=10)
    assert [computed_steps(m) for m, _ in climbed[:3]] == [[0, 1, 3, 6], [0, 3, 4, 6], [0, 4, 5, 6]]
    assert len(climbed) == 10 and [m for m, _ in climbed] == scored
    assert [sum(m) for m, _ in search_below_target(beam, score, target=14.0, budget=40)][:34] == [4] * 33 + [3]
    # no count meets the target: the costliest count is searched, and nothing below it
    assert {sum(m) for m, _ in search_below_target(beam, score, target=100.0, budget=100)} == {5}
    assert search_below_target({}, score, target=14.0, budget=100) == []


def test_calibrate_on_a_short_schedule_scores_the_masks_below_target_after_the_beam_search(
    turbo_runner, tmp_path, monkeypatch
):
    import dicache.tuning.search as search_module
    from dicache.engine.policies import step_mask
    from dicache.tuning import PipelineRunner, calibrate
    from dicache.tuning.predictor import PredictorSearch, parse_mask

    runner = PipelineRunner(turbo_runner.pipe, 5, 1.0, "turbo", 32, 32)
    samples = [("dog face", 3), ("red apple", 5)]
    climbed = parse_mask("0,3", 5)  # a mask the beam search (stopping after its first round) never scores
    seen = {}

    def climb(known, score, *, target, budget):
        seen.update(known=dict(known), target=target, budget=budget)
        return [(climbed, score(climbed))]

    monkeypatch.setattr(search_module, "search_below_target", climb)
    search = PredictorSearch(runner, samples, 1, tmp_path / "p", climb=7)
    result = calibrate(runner, samples, [], target_psnr=99.0, criterion="mean", progress=False, predictor=search)
    masks = [tuple(step_mask(c.config, 5)) for c in result.candidates]
    assert set(seen["known"]) == set(masks[:-1]) and seen["target"] == 99.0 and seen["budget"] == 7
    assert masks[-1] == climbed and len(set(masks)) == len(masks) == search.fits  # scored like every fitted mask
    files = {i: Path(c.fitted_predictor).name for i, c in result.candidates[-1].sample_configs.items()}
    assert files == {i: f"mask-10010-without-{i}.safetensors" for i in (0, 1)}


def test_calibrate_on_a_long_schedule_fits_the_curved_masks_then_climbs(turbo_runner, tmp_path):
    from dicache.engine.policies import step_mask
    from dicache.tuning import PipelineRunner, calibrate
    from dicache.tuning.predictor import PredictorSearch, long_schedule_masks

    runner = PipelineRunner(turbo_runner.pipe, 13, 1.0, "turbo", 32, 32)
    samples = [("dog face", 3), ("red apple", 5)]
    search = PredictorSearch(runner, samples, 1, tmp_path / "p", budgets=(0.2,), climb=2)
    result = calibrate(runner, samples, [], target_psnr=99.0, criterion="mean", progress=False, predictor=search)
    masks = [tuple(step_mask(c.config, 13)) for c in result.candidates]
    curved = long_schedule_masks(13, (0.2,))
    assert masks[: len(curved)] == curved and len(masks) == len(curved) + 2 == search.fits  # 2 climbing masks
    assert {sum(m) for m in masks} == {3} and len(set(masks)) == len(masks)  # one budget, each mask once
    assert all(c.status == "complete" and c.config.cached_step_method == "fitted" for c in result.candidates)
    # a climbed mask is scored like every fitted one: each prompt by the fit made without its fold
    for candidate in result.candidates[len(curved) :]:
        files = {i: Path(c.fitted_predictor).name for i, c in candidate.sample_configs.items()}
        assert files == {i: f"mask-{''.join(map(str, candidate.fitted_mask))}-without-{i}.safetensors" for i in (0, 1)}


def test_fit_masks_replace_the_curved_masks_and_bad_ones_name_the_flag(turbo_runner, tmp_path, capsys):
    from dicache.cli import main
    from dicache.engine.policies import step_mask
    from dicache.tuning import CalibrationError, PipelineRunner, calibrate
    from dicache.tuning.predictor import PredictorSearch, parse_mask

    assert parse_mask("0,2,5", 7) == (1, 0, 1, 0, 0, 1, 0)
    for bad in ("1,2", "0,7", "0,x", ""):
        with pytest.raises(CalibrationError, match=f"--fit-masks='{bad}' is invalid: .* 0 … 6, step 0 among them"):
            parse_mask(bad, 7)
    runner = PipelineRunner(turbo_runner.pipe, 13, 1.0, "turbo", 32, 32)
    samples = [("dog face", 3), ("red apple", 5)]
    start = parse_mask("0,1,3,7", 13)
    search = PredictorSearch(runner, samples, 1, tmp_path / "p", starts=[start], climb=0)
    result = calibrate(runner, samples, [], target_psnr=99.0, criterion="mean", progress=False, predictor=search)
    assert [tuple(step_mask(c.config, 13)) for c in result.candidates] == [start] and search.fits == 1
    # a short schedule: the given masks first (the beam search may not reach them), then the search, each mask once
    runner = PipelineRunner(turbo_runner.pipe, 5, 1.0, "turbo", 32, 32)
    start = parse_mask("0,2", 5)
    search = PredictorSearch(runner, samples, 1, tmp_path / "p5", starts=[start], climb=0)
    result = calibrate(runner, samples, [], target_psnr=99.0, criterion="mean", progress=False, predictor=search)
    masks = [tuple(step_mask(c.config, 5)) for c in result.candidates]
    assert masks[0] == start and len(set(masks)) == len(masks) == search.fits
    assert [sum(m) for m in masks] == [2, 4, 4, 4, 4]  # then the search's first round (no 4-step mask met 99 dB)
    # on the command line; a bad mask names the flag
    argv = ["calibrate", "--steps", "4", "--guidance", "1", "--size", "32", "--prompts", "2", "--device", "cpu"]
    code = main([*argv, "--fit-masks", "0,4", "--out", str(tmp_path / "x.json"), "--no-progress"])
    assert code == 2 and "--fit-masks='0,4' is invalid" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------ tokens
def plain_attention(q, k, v, key_mask=None):
    """softmax(q·kᵀ/√d)·v, `(B, H, S, D)`."""
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


class SelfAttention(torch.nn.Module):
    kernel = staticmethod(plain_attention)
    num_heads, head_dim = 1, 2

    def forward(self, x, key_mask=None):
        q = x[:, None]
        return self.kernel(q, q, q, key_mask)[:, 0]


class TokenBlock(torch.nn.Module):
    """`h + t · attention(h)` (q = k = v = h): small enough to follow by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = SelfAttention()

    def forward(self, hidden_states, temb, attention_mask=None):
        return hidden_states + temb * self.attn(hidden_states, attention_mask)

    @staticmethod
    def token_rows(rows, hidden_states, temb, attention_mask=None):
        return hidden_states, temb, attention_mask


class TokenTransformer(torch.nn.Module):
    def __init__(self, num_blocks: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(TokenBlock() for _ in range(num_blocks))

    def forward(self, hidden_states, timestep):
        return self.run_blocks(hidden_states, timestep.reshape(-1, 1, 1))

    def run_blocks(self, hidden_states, *block_args):
        for block in self.blocks:
            hidden_states = block(hidden_states, *block_args)
        return hidden_states


def tokens_config(share: float) -> CacheConfig:
    return CacheConfig.from_env(
        {},
        scm_compute_bins=[1],
        scm_cache_bins=[1],
        scm_policy="static",
        max_warmup_steps=0,
        Fn_compute_blocks=0,
        cached_step_method="tokens",
        cached_step_tokens=share,
    )


def test_token_subset_runs_the_changed_rows_against_kept_keys_by_hand():
    torch.manual_seed(5)
    model = TokenTransformer(2).eval()
    x0 = torch.randn(1, 4, 2)
    x1 = x0.clone()
    x1[0, 1] += torch.tensor([0.9, -0.4])  # rows 1 and 3 move most: the two a share of 0.5 computes
    x1[0, 3] += torch.tensor([-0.7, 0.8])
    x1[0, 0] += 0.01
    t0, t1 = torch.tensor([1.0]), torch.tensor([0.6])
    dicache.enable(model, tokens_config(0.5))
    try:
        with torch.no_grad(), dicache.request(model, num_inference_steps=2):
            out0, out1 = model(x0, t0), model(x1, t1)
        stats = dicache.stats(model)
        kernels = [type(block.attn.__dict__.get("kernel")).__name__ for block in model.blocks]
    finally:
        dicache.disable(model)
    assert kernels == ["KernelTap", "KernelTap"] and all("kernel" not in b.attn.__dict__ for b in model.blocks)

    def attend(q, k, v):
        return torch.softmax(q @ k.T / 2**0.5, dim=-1) @ v

    with torch.no_grad():
        torch.testing.assert_close(out0, model(x0, t0), rtol=0, atol=0)  # the computed call is the plain model
        h = [x0[0]]  # the computed call's stream entering each block: the keys/values kept
        for _ in model.blocks:
            h.append(h[-1] + 1.0 * attend(h[-1], h[-1], h[-1]))
        rows = [1, 3]
        r = x1[0, rows]
        for b in range(2):  # the rows through each block, attending to the kept keys with their own rows fresh
            keys = h[b].clone()
            keys[rows] = r
            r = r + 0.6 * attend(r, keys, keys)
        expected = x1[0] + (h[2] - h[0])  # the other rows: the reused residual of the computed call
        expected[rows] = r
    torch.testing.assert_close(out1[0], expected)
    branch = stats.branches["cond"]
    assert branch.computed_steps == [0] and branch.cached_steps == [1]
    # each block at 2 of 4 rows: linears none, attention 2·4 of 4·4 query-key pairs -> half a block each
    assert stats.partial_blocks == pytest.approx(2 * 0.5) and stats.blocks_run == pytest.approx(2 + 1)


def test_token_subsets_need_blocks_that_declare_them():
    model = SeamTransformer(num_blocks=3, dim=DIM).eval()
    dicache.enable(model, tokens_config(0.5))
    try:
        with pytest.raises(ConfigError, match="token_rows"), dicache.request(model, num_inference_steps=2):
            drive(model, torch.randn(1, 4, DIM), 2)
    finally:
        dicache.disable(model)


def test_calibrate_quantized_measures_against_the_unquantized_model(tmp_path, capsys):
    from dicache.cli import main

    candidates = tmp_path / "c.json"
    candidates.write_text(json.dumps([{"policy": "never"}]))  # every block computed: the quantization's own error
    out = tmp_path / "int8.json"
    argv = ["calibrate", "--variant", "turbo", "--steps", "4", "--size", "32", "--prompts", "1", "--device", "cpu"]
    argv += ["--no-step-masks", "--candidates", str(candidates), "--target-psnr", "20", "--out", str(out)]
    assert main([*argv, "--quantization", "int8", "--no-progress"]) == 0, capsys.readouterr().out
    record = json.loads(out.read_text())["calibration"]
    assert record["quantization"] == {"method": "int8", "exclude": []}
    uncached = record["candidates"][0]
    assert uncached["compute_fraction"] == 1.0 and 20 < uncached["psnr_min_db"] < 100  # INT8 vs float32, not 100
    assert main([*argv, "--quantization", "fp8"]) == 2
    assert "FP8 tensor cores" in capsys.readouterr().err
