"""TeaCache, MagCache, EasyCache (policies) and FoCa, DMD (calibrators): hand-computed sequences, the settings rules,
and each running through the hook with per-request overrides."""

import pytest
import torch
from toymodels import LinearInTimeBlock, ToyTransformer, sample

import dicache
from dicache import CacheConfig, ConfigError
from dicache.engine.calibrators import DMDCalibrator, FoCaCalibrator, make_calibrator
from dicache.engine.policies import EasyCachePolicy, MagCachePolicy, StepContext, TeaCachePolicy, make_policy
from dicache.engine.policies.magcache import resample
from dicache.engine.policies.teacache import polynomial
from dicache.engine.reduction import change_ratio
from dicache.engine.stats import RECORDER
from dicache.sweep.compare import algorithm_rows
from dicache.sweep.report import algorithm_lines
from dicache.sweep.settings import algorithm, cell_label, recommended
from dicache.tuning.fits import ResidualTrace, fit_polynomial, fit_rescale, magcache_profile


def ctx(step, accumulated=0.0, continuous=0, rate=None, num_steps=10):
    return StepContext(step, num_steps, 0, continuous, True, True, accumulated=accumulated, rate=rate)


def never_called():
    raise AssertionError("the diff was read")


def run_policy(policy, diffs, start, num_steps=10, rate=None):
    """Feed `diffs` (one per step from `start`) through `policy`, carrying the accumulator and the cached run."""
    acc, run, out = 0.0, 0, []
    for step, value in enumerate(diffs, start):
        d = policy.decide(ctx(step, acc, run, rate, num_steps), lambda v=value: v)
        acc = d.accumulated or 0.0 if d.cache else 0.0
        run = run + 1 if d.cache else 0
        out.append((d.cache, d.reason, None if d.accumulated is None else round(d.accumulated, 9)))
    return out


# ---------------------------------------------------------------- policies
def test_teacache_accumulates_the_rescaled_change_and_resets_on_compute():
    assert polynomial([2.0, 0.0], 0.1) == pytest.approx(0.2)
    assert polynomial([1.0, -2.0, 3.0], 2.0) == pytest.approx(3.0)  # x² − 2x + 3
    policy = TeaCachePolicy(warmup=2, threshold=0.5, coefficients=[2.0, 0.0])
    assert policy.decide(ctx(1), never_called).reason == "warmup"
    # rescaled: 0.2, 0.2, 0.4, 0.1 -> sums 0.2 (cache), 0.4 (cache), 0.8 (compute, reset), 0.1 (cache)
    assert run_policy(policy, [0.1, 0.1, 0.2, 0.05], start=2) == [
        (True, "accumulated", 0.2),
        (True, "accumulated", 0.4),
        (False, "accumulated", None),
        (True, "accumulated", 0.1),
    ]
    assert policy.decide(ctx(9), never_called).reason == "last_step"
    assert TeaCachePolicy(0, 0.0, [1.0, 0.0]).uses_diff is False
    assert TeaCachePolicy(0, 0.1, [1.0, 0.0]).signal == "fn_residual_consecutive"


def test_magcache_error_follows_the_ratio_profile_and_the_skip_limit():
    ratios = [1.0, 1.0, 0.9, 0.8, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0]
    policy = MagCachePolicy(warmup=2, threshold=0.3, max_skip=2, ratios=ratios)
    # step 2: |1−0.9| = 0.1 -> cache; step 3: 0.1 + |1−0.72| = 0.38 -> compute; step 4: 0 -> cache;
    # step 5: 0 + |1−0.5| = 0.5 -> compute; steps 6, 7 cache (error 0); step 8: the run of 2 is the limit
    decisions = [policy.decide(ctx(s, continuous=c), never_called) for s, c in [(2, 0), (3, 1), (4, 0), (5, 1)]]
    assert [d.cache for d in decisions] == [True, False, True, False]
    assert [d.diff for d in decisions] == pytest.approx([0.1, 0.38, 0.0, 0.5])
    assert policy.decide(ctx(8, continuous=2), never_called).reason == "max_continuous"
    assert policy.uses_diff is False
    assert resample([1.0, 2.0, 3.0], 5) == [1.0, 1.0, 2.0, 3.0, 3.0]
    assert resample([1.0, 2.0], 2) == [1.0, 2.0]


def test_easycache_predicts_the_change_from_the_transformation_rate():
    policy = EasyCachePolicy(warmup=2, threshold=0.3)
    assert policy.decide(ctx(3, rate=None), never_called).reason == "no_residual"  # no rate measured yet
    # rate 2: predicted 0.2 (cache), 0.4 (compute, reset), 0.1 (cache)
    assert run_policy(policy, [0.1, 0.1, 0.05], start=2, rate=2.0) == [
        (True, "accumulated", 0.2),
        (False, "accumulated", None),
        (True, "accumulated", 0.1),
    ]
    assert policy.decide(ctx(9, rate=2.0), never_called).reason == "last_step"
    assert policy.signal == "input_change"


def test_change_ratio_and_make_policy():
    a, b = (torch.tensor([3.0, 1.0]),), (torch.tensor([1.0, 1.0]),)
    assert change_ratio(a, b, b) == pytest.approx(1.0)  # |2| + 0 over |1| + |1|
    assert change_ratio(a, b, a, (torch.tensor([2.0, 2.0]),)) == pytest.approx(1.0)  # 2 over |1| + |−1|
    config = CacheConfig.from_env({}, policy="magcache", magcache_ratios="1,0.9,0.8", magcache_thresh=0.2)
    policy = make_policy(config, 3)
    assert isinstance(policy, MagCachePolicy) and policy.ratios == (1.0, 0.9, 0.8) and policy.threshold == 0.2
    assert isinstance(make_policy(config.merged({"policy": "teacache"}), 3), TeaCachePolicy)
    assert isinstance(make_policy(config.merged({"policy": "easycache"}), 3), EasyCachePolicy)


# ---------------------------------------------------------------- calibrators
def test_foca_is_exact_on_lines_and_calibrates_with_its_last_forecast():
    line = FoCaCalibrator()
    for x in (0.0, 1.0):
        line.update(x, torch.tensor([1.0 + 2 * x]))
    assert line.estimate(2.0).item() == pytest.approx(5.0) and line.estimate(3.5).item() == pytest.approx(8.0)
    foca = FoCaCalibrator()
    foca.update(0.0, torch.tensor([0.0]))
    assert foca.estimate(0.5).item() == 0.0  # one computed step: reuse
    foca.update(1.0, torch.tensor([1.0]))
    assert foca.estimate(2.0).item() == pytest.approx(2.0)  # slopes 1 and 1
    foca.update(3.0, torch.tensor([2.5]))  # anchor slope (2.5 − 1) / 2 = 0.75; local (2.5 − 2) / 1 = 0.5
    assert foca.estimate(4.0).item() == pytest.approx(2.5 + 1 * (0.75 + 0.5) / 2)  # 3.125
    assert foca.estimate(4.0).item() == pytest.approx(3.125)  # asked again: the same
    assert foca.estimate(5.0).item() == pytest.approx(2.5 + 2 * (0.75 + 0.625) / 2)  # local (3.125 − 2.5) / 1
    damped = FoCaCalibrator(damping=0.5)
    for x, m in ((0.0, 0.0), (1.0, 1.0)):
        damped.update(x, torch.tensor([m]))
    assert damped.estimate(3.0).item() == pytest.approx(1.0 + 0.5 * 2 * 1.0)


def test_dmd_is_exact_on_lines_and_on_geometric_rates():
    direction = torch.tensor([[1.0, 2.0]])
    geometric = DMDCalibrator(history=6)
    for x, m in ((0.0, 0.0), (1.0, 1.0), (2.0, 1.5), (3.0, 1.75)):  # rates 1, 1/2, 1/4
        geometric.update(x, m * direction)
    torch.testing.assert_close(geometric.estimate(4.0), 1.875 * direction, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(geometric.estimate(5.0), 1.9375 * direction, rtol=1e-6, atol=1e-6)
    line = DMDCalibrator(history=4)
    for x in (0.0, 0.5, 1.0, 1.5, 2.0):
        line.update(x, (1.0 - 3.0 * x) * direction)
    torch.testing.assert_close(line.estimate(3.0), -8.0 * direction, rtol=1e-6, atol=1e-6)
    assert line.stored_tensors == 4  # the newest residual and 3 rates
    two = DMDCalibrator()
    two.update(0.0, torch.tensor([[1.0]]))
    assert two.estimate(1.0).item() == 1.0  # one computed step: reuse
    two.update(2.0, torch.tensor([[2.0]]))
    assert two.estimate(3.0).item() == pytest.approx(2.5)  # two: order-1 TaylorSeer


def test_make_calibrator_picks_the_forecaster():
    def make(**kw):
        return make_calibrator(CacheConfig.from_env({}, **kw))

    assert isinstance(make(enable_taylorseer=True, forecaster="foca"), FoCaCalibrator)
    dmd = make(enable_dmd=True, dmd_history=4, dmd_rank=2)
    assert isinstance(dmd, DMDCalibrator) and (dmd.history, dmd.rank) == (4, 2)


# ---------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "overrides, names",
    [
        ({"enable_dmd": True, "enable_taylorseer": True}, ("enable_dmd", "enable_taylorseer")),
        ({"forecaster": "foca"}, ("forecaster", "enable_taylorseer")),
        ({"policy": "teacache", "Fn_compute_blocks": 0}, ("teacache", "Fn_compute_blocks")),
        ({"policy": "magcache"}, ("magcache", "magcache_ratios")),
        ({"policy": "easycache", "scm_preset": "fast", "scm_policy": "static"}, ("easycache", "scm_policy")),
    ],
)
def test_invalid_combinations_name_both_settings(overrides, names):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_env({}, **overrides)
    assert all(name in str(info.value) for name in names)


def test_lists_read_from_the_environment():
    config = CacheConfig.from_env(
        {"SGLANG_CACHE_DIT_TEACACHE_COEFFICIENTS": "[2, -0.5, 0.1]", "SGLANG_CACHE_DIT_MAGCACHE_RATIOS": "1,0.95"}
    )
    assert config.teacache_coefficients == [2.0, -0.5, 0.1] and config.magcache_ratios == [1.0, 0.95]
    with pytest.raises(ConfigError, match="MAGCACHE_RATIOS"):
        CacheConfig.from_env({"SGLANG_CACHE_DIT_MAGCACHE_RATIOS": "1,-1"})


# ---------------------------------------------------------------- through the hook
@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    return ToyTransformer(num_blocks=6, dim=16).eval(), torch.randn(2, 5, 16)


def steps_of(model):
    b = dicache.stats(model).branches["cond"]
    return b.computed_steps, b.cached_steps, b


@pytest.mark.parametrize(
    "overrides, computed",
    [
        ({"policy": "teacache", "teacache_thresh": 1e9}, [0, 1, 5]),
        ({"policy": "teacache", "teacache_thresh": 1e-9}, [0, 1, 2, 3, 4, 5]),
        ({"policy": "easycache", "easycache_thresh": 1e9}, [0, 1, 5]),
        ({"policy": "easycache", "easycache_thresh": 1e-9}, [0, 1, 2, 3, 4, 5]),
        ({"policy": "magcache", "magcache_ratios": [1.0] * 6, "max_continuous_cached_steps": 2}, [0, 1, 4]),
        ({"policy": "magcache", "magcache_ratios": [0.5] * 6, "magcache_thresh": 0.4}, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_each_policy_runs_through_the_hook_with_per_request_overrides(toy, overrides, computed):
    model, x = toy
    dicache.enable(model, CacheConfig.from_env({}, max_warmup_steps=2))  # the base settings: DBCache
    try:
        with dicache.request(model, num_inference_steps=6, config=overrides), torch.no_grad():
            out = sample(model, x, 6)
        done, cached, branch = steps_of(model)
        assert done == computed and cached == sorted(set(range(6)) - set(computed))
        assert all(torch.isfinite(o).all() for o in out)
        if overrides["policy"] != "magcache" and cached:
            assert set(branch.diffs) >= set(cached)  # the signal was measured for every cached step
    finally:
        dicache.disable(model)


@pytest.mark.parametrize(
    "forecaster", [{"enable_taylorseer": True, "forecaster": "foca"}, {"enable_dmd": True, "dmd_history": 3}]
)
def test_foca_and_dmd_extrapolate_a_linear_middle_residual_exactly_through_the_engine(forecaster):
    torch.manual_seed(3)
    model = ToyTransformer(num_blocks=5, dim=8, block=LinearInTimeBlock).eval()
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        plain = sample(model, x, 8)
    base = dict(max_warmup_steps=3, residual_diff_threshold=1e9, max_continuous_cached_steps=-1)
    dicache.enable(model, CacheConfig.from_env({}, **base))
    try:
        with dicache.request(model, config=forecaster), torch.no_grad():
            out = sample(model, x, 8)
        assert steps_of(model)[1] == [3, 4, 5, 6, 7]
        for s in range(3, 8):
            torch.testing.assert_close(out[s], plain[s], rtol=1e-5, atol=1e-5)
    finally:
        dicache.disable(model)


def test_a_recorder_hears_every_computed_call(toy):
    model, x = toy
    heard = []

    class Recorder:
        def record(self, branch, step, stack_in, fn_out, middle_out):
            heard.append((branch, step, stack_in[0].shape, fn_out[0].shape, middle_out[0].shape))

    dicache.enable(model, CacheConfig.from_env({}, policy="never"))
    token = RECORDER.set(Recorder())
    try:
        with torch.no_grad():
            sample(model, x, 3, branches=2)
    finally:
        RECORDER.reset(token)
        dicache.disable(model)
    assert [(b, s) for b, s, *_ in heard] == [
        ("cond", 0),
        ("uncond", 0),
        ("cond", 1),
        ("uncond", 1),
        ("cond", 2),
        ("uncond", 2),
    ]
    assert heard[0][2:] == (x.shape,) * 3


# ---------------------------------------------------------------- calibrate's fits
def test_residual_trace_and_fits_on_hand_made_sequences():
    trace = ResidualTrace()
    base = torch.ones(1, 2, 4)
    for step, (fn, out) in enumerate([(1.0, 2.0), (2.0, 4.0), (4.0, 6.0)]):  # stack input 1 everywhere
        trace.record("cond", step, (base,), (base * (1 + fn),), (base * (1 + out),))
    # Fn residual 1 -> 2 -> 4: x = 1, 1; output 3 -> 5 -> 7: y = 2/3, 2/5; residual norms 2 -> 4 -> 6: ratios 2, 1.5
    assert trace.teacache == [pytest.approx((1.0, 2 / 3)), pytest.approx((1.0, 0.4))]
    assert magcache_profile(trace.ratios, 4) == pytest.approx([1.0, 2.0, 1.5, 1.0])
    assert fit_polynomial([(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)], degree=1) == pytest.approx([2.0, 1.0])
    quadratic = fit_polynomial([(x / 4, (x / 4) ** 2 - 1) for x in range(6)], degree=4)
    assert polynomial(quadratic, 0.3) == pytest.approx(0.09 - 1, abs=1e-9)  # exact through its points
    assert fit_polynomial([(1.0, 2.0), (1.0, 4.0)]) == pytest.approx([3.0])  # one distinct x: the mean
    assert fit_polynomial([]) == [1.0, 0.0]
    # a quadratic that falls beyond its points is refused for the line through them
    falling = [(0.1, 0.1), (0.2, 0.3), (0.3, 0.35), (0.4, 0.3)]
    assert len(fit_polynomial(falling, 2)) == 3 and len(fit_rescale(falling, 2)) == 2
    assert fit_rescale([(0.1, 0.3), (0.2, 0.1)]) == [1.0, 0.0]  # nothing rises: the identity


# ---------------------------------------------------------------- the sweep's view
def test_each_algorithm_is_a_family_with_a_compact_label():
    rec = recommended(0.3)
    cases = [
        (rec, "recommended", "F0B0 W0 SCM curved 0.3 γ2.5/static TS1σ d0.5"),
        ({**rec, "forecaster": "foca"}, "foca", "F0B0 W0 SCM curved 0.3 γ2.5/static FoCaσ d0.5"),
        ({**rec, "enable_taylorseer": False, "enable_dmd": True}, "dmd", "F0B0 W0 SCM curved 0.3 γ2.5/static DMD6σ"),
        ({"policy": "teacache", "teacache_coefficients": [1.7, 0.1]}, "teacache", "F1B0 W4 TeaCache 0.25"),
        (
            {"policy": "magcache", "magcache_ratios": [1.0] * 9, "Fn_compute_blocks": 0},
            "magcache",
            "F0B0 W4 MC3 MagCache 0.06",
        ),
        ({"policy": "easycache", "easycache_thresh": 0.3}, "easycache", "F1B0 W4 EasyCache 0.3"),
        ({"residual_diff_threshold": 0.12}, "dbcache", "F1B0 W4 MC3 R0.12"),
        ({**rec, "taylorseer_damping": 0.35, "forecaster": "corrected"}, "recommended", None),
        ({**rec, "taylorseer_distance": "step"}, "dbcache", None),
        ({"policy": "magcache"}, "other", None),  # no profile: not a valid config
    ]
    for overrides, family, text in cases:
        assert algorithm(overrides) == family
        if text is not None:
            assert cell_label(CacheConfig.defaults().merged(overrides)) == text


def test_algorithm_rows_compare_each_family_with_the_baselines_and_the_recommendation():
    def record(method, compute, value, settings=None):
        return {
            "method": method,
            "schedule_slug": "s",
            "compute_fraction": compute,
            "psnr": value,
            "settings": settings,
        }

    records = [
        record("ours", 0.3, 30.0, recommended(0.3)),
        record("ours", 0.32, 27.5, {"policy": "easycache"}),
        record("ours", 0.5, 40.0, {"policy": "easycache"}),
        record("fewer-steps", 0.2, 20.0),
        record("fewer-steps", 0.6, 28.0),
    ]
    results = {"records": records, "meta": {"compute_targets": [0.3, 0.5]}}
    rows = {r["algorithm"]: r["bins"] for r in algorithm_rows(results, "s")}
    assert list(rows) == ["recommended", "easycache"]
    assert rows["recommended"][0]["margin"] == pytest.approx(30.0 - 22.0)  # fewer steps interpolated at 0.3: 22 dB
    assert rows["easycache"][0]["vs_recommended"] == pytest.approx(-2.5)
    assert rows["easycache"][1]["vs_recommended"] is None and rows["easycache"][1]["value"] == 40.0
    assert rows["easycache"][0]["best_measured"] == "fewer-steps"
    text = "\n".join(algorithm_lines(results, "s"))
    assert "| easycache | 27.5 (+5.1 / -2.5) | 40.0 (+14.0) |" in text  # at 0.32 fewer steps give 22.4 dB
