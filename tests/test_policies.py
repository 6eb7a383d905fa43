import pytest

from dicache import CacheConfig, ConfigError
from dicache.engine.policies import AlwaysCache, DBCachePolicy, NeverCache, StepContext, make_policy, preset_mask
from dicache.engine.policies.step_mask import PRESET_BINS, mask_from_bins, step_mask


def ctx(step, cached_total=0, continuous=0, has=True, num_steps=None):
    return StepContext(step, num_steps, cached_total, continuous, has, has)


def never_called():
    raise AssertionError("the diff must not be measured here")


def const(value):
    calls = []

    def diff():
        calls.append(1)
        return value

    diff.calls = calls
    return diff


def test_warmup_wins_over_everything():
    p = DBCachePolicy(warmup=3, threshold=10.0, max_continuous=-1, mask=[0] * 10, static_mask=True)
    for s in range(3):
        d = p.decide(ctx(s), never_called)
        assert not d.cache and d.reason == "warmup"
    assert p.decide(ctx(3), never_called).cache


def test_threshold_is_strict_and_diff_is_lazy():
    p = DBCachePolicy(warmup=0, threshold=0.2, max_continuous=-1)
    below, equal = const(0.1999), const(0.2)
    assert p.decide(ctx(5), below).cache and below.calls == [1]
    d = p.decide(ctx(5), equal)
    assert not d.cache and d.reason == "diff" and d.diff == 0.2


def test_rule_order_max_cached_then_mc_then_threshold_off_then_residual():
    p = DBCachePolicy(warmup=0, threshold=1.0, max_continuous=2, max_cached=4)
    assert p.decide(ctx(9, cached_total=4, continuous=0), never_called).reason == "max_cached"
    assert p.decide(ctx(9, cached_total=3, continuous=2), never_called).reason == "max_continuous"
    assert p.decide(ctx(9, cached_total=3, continuous=1), const(0.5)).cache
    assert DBCachePolicy(0, 0.0, -1).decide(ctx(9), never_called).reason == "threshold_off"
    assert DBCachePolicy(0, 1.0, -1).decide(ctx(9, has=False), never_called).reason == "no_residual"
    assert DBCachePolicy(0, 1.0, 0).decide(ctx(9), never_called).reason == "max_continuous"  # MC=0: never cache


def test_dynamic_mask_only_forbids_static_mask_forces():
    mask = [1, 1, 0, 0, 1, 0]
    dyn = DBCachePolicy(warmup=0, threshold=0.1, max_continuous=-1, mask=mask)
    assert dyn.decide(ctx(1), never_called).reason == "mask"
    assert not dyn.decide(ctx(2), const(0.5)).cache  # 0 in the mask: the diff still decides
    assert dyn.decide(ctx(3), const(0.05)).cache
    static = DBCachePolicy(warmup=0, threshold=0.1, max_continuous=1, mask=mask, static_mask=True)
    assert static.decide(ctx(3, continuous=5), never_called).cache  # static ignores MC and the diff
    assert static.decide(ctx(3, has=False), never_called).reason == "no_residual"
    assert not static.decide(ctx(4), never_called).cache
    assert not static.uses_diff and dyn.uses_diff


def test_never_and_always():
    assert not NeverCache().decide(ctx(10), never_called).cache
    assert AlwaysCache().decide(ctx(0), never_called).cache
    assert not AlwaysCache().decide(ctx(0, has=False), never_called).cache


def test_presets_at_28_steps_are_the_defined_bins():
    for name, (compute, cache) in PRESET_BINS.items():
        expected = []
        for i, c in enumerate(compute):
            expected += [1] * c + ([0] * cache[i] if i < len(cache) else [])
        assert preset_mask(name, 28) == expected


@pytest.mark.parametrize("n", [4, 5, 8, 9, 13, 20, 28, 31, 50, 100])
def test_presets_rescale_to_any_count_keeping_fraction_and_order(n):
    fractions = []
    for name in ("slow", "medium", "fast", "ultra"):
        mask = preset_mask(name, n)
        assert len(mask) == n and mask[0] == 1 and mask[-1] == 1
        fractions.append(sum(mask) / n)
        target = sum(PRESET_BINS[name][0]) / 28
        assert abs(sum(mask) / n - target) <= 1.5 / n + 1e-9 or n < 8
        # compute is front-loaded: the first half computes at least as much as the second (but its forced last step)
        assert sum(mask[: n // 2]) >= sum(mask[n // 2 :]) - 1
    assert fractions == sorted(fractions, reverse=True)  # slow >= medium >= fast >= ultra


def test_preset_needs_four_steps_and_known_count():
    with pytest.raises(ConfigError, match="num_inference_steps >= 4"):
        preset_mask("fast", 3)
    with pytest.raises(ConfigError, match="needs the number of inference steps"):
        step_mask(CacheConfig.from_env({"SGLANG_CACHE_DIT_SCM_PRESET": "fast"}), None)


def test_explicit_bins():
    assert mask_from_bins([2, 1], [3], 6) == [1, 1, 0, 0, 0, 1]
    assert mask_from_bins([2, 1], [3, 4], 5) == [1, 1, 0, 0, 0]
    with pytest.raises(ConfigError, match="cover 6 steps.*num_inference_steps=8"):
        mask_from_bins([2, 1], [3], 8)


def test_explicit_bins_build_only_the_steps_asked_for():
    """A long bin costs nothing beyond the step count (it used to be expanded in full before being cut)."""
    import tracemalloc

    tracemalloc.start()
    try:
        assert mask_from_bins([10_000_000], [1], 4) == [1, 1, 1, 1]
        assert mask_from_bins([1, 1], [10_000_000], 3) == [1, 0, 0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak  # a 10-million-entry list is 80 MB


def test_make_policy_follows_config():
    cfg = CacheConfig.from_env({"SGLANG_CACHE_DIT_SCM_PRESET": "ultra", "SGLANG_CACHE_DIT_SCM_POLICY": "static"})
    p = make_policy(cfg, 28)
    assert isinstance(p, DBCachePolicy) and p.static_mask and p.mask == preset_mask("ultra", 28)
    assert isinstance(make_policy(cfg.merged({"policy": "never"}), 28), NeverCache)
    assert isinstance(make_policy(cfg.merged({"policy": "always"}), 28), AlwaysCache)


def test_curved_mask_count_placement_and_design_formula():
    from dicache.engine.policies import curved_mask
    from dicache.engine.policies.step_mask import curved_positions

    for n in (8, 28, 50):
        for f in (0.3, 0.5, 0.8):
            mask = curved_mask(n, f, 2.5)
            assert len(mask) == n and sum(mask) == max(2, round(f * n)) and mask[0] == mask[-1] == 1
            if sum(mask) > 2:
                assert sum(mask[: n // 2]) > sum(mask[n // 2 :]), "a curve > 1 computes more steps at high noise"
    # docs/architecture.md §8's static schedule: round((j/(k−1))^1.5·(n−1)) when the targets do not collide
    assert curved_positions(28, 8, 1.5) == [round((j / 7) ** 1.5 * 27) for j in range(8)]
    assert curved_positions(9, 5, 1.0) == [0, 2, 4, 6, 8]  # curve 1: evenly spread
    assert curved_mask(10, 1.0, 3.0) == [1] * 10


def test_make_policy_builds_curved_masks():
    config = CacheConfig.from_env(
        {},
        scm_preset="curved",
        scm_compute_fraction=0.4,
        scm_curve=2.0,
        scm_policy="static",
    )
    p = make_policy(config, 20)
    assert sum(p.mask) == 8 and p.static_mask
    with pytest.raises(ConfigError, match="scm_compute_fraction.*0, 1"):
        CacheConfig.from_env({}, scm_compute_fraction=0)
    with pytest.raises(ConfigError, match="SGLANG_CACHE_DIT_SCM_CURVE='0.5'.*>= 1"):
        CacheConfig.from_env({"SGLANG_CACHE_DIT_SCM_CURVE": "0.5"})
    with pytest.raises(ConfigError, match="SGLANG_CACHE_DIT_TS_DAMPING='2'.*0, 1"):
        CacheConfig.from_env({"SGLANG_CACHE_DIT_TS_DAMPING": "2"})


def test_middle_segments_split_the_middle_into_skipped_and_computed_runs():
    from dicache.engine.policies import Segment, middle_segments

    assert middle_segments(10, 1, 0, None) == [Segment(1, 10, True)]
    assert middle_segments(10, 0, 0, [4, 5]) == [Segment(0, 4, True), Segment(4, 6, False), Segment(6, 10, True)]
    assert middle_segments(6, 1, 1, [1, 3]) == [
        Segment(1, 2, False),
        Segment(2, 3, True),
        Segment(3, 4, False),
        Segment(4, 5, True),
    ]
    assert sum(s.size for s in middle_segments(10, 2, 3, [5, 2])) == 5
    with pytest.raises(ValueError, match=r"outside the middle \[1, 9\)"):
        middle_segments(10, 1, 1, [9])


def test_every_policy_declares_uses_diff():
    """`uses_diff` is part of the `CachePolicy` contract: the engine reads it, it does not guess a default."""
    assert NeverCache().uses_diff is False and AlwaysCache().uses_diff is False
    assert DBCachePolicy(warmup=0, threshold=0.2, max_continuous=-1).uses_diff is True
    assert DBCachePolicy(warmup=0, threshold=0.0, max_continuous=-1).uses_diff is False
    static = DBCachePolicy(warmup=0, threshold=0.2, max_continuous=-1, mask=[1, 0], static_mask=True)
    assert static.uses_diff is False
