"""The hook layer and DBCache semantics on small block-stack models (docs/architecture.md §2)."""

import copy
import threading

import pytest
import torch
from toymodels import (
    DualTransformer,
    LinearInTimeBlock,
    ScaleBlock,
    SeamTransformer,
    ToyTransformer,
    sample,
    timesteps,
)

import dicache
from dicache import BlockSplitError, CacheConfig, ConfigError
from dicache.engine.adapters import DualStream


def cfg(**kw):
    return CacheConfig.from_env({}, **kw)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return ToyTransformer(num_blocks=6, dim=16).eval()


@pytest.fixture
def x():
    torch.manual_seed(1)
    return torch.randn(2, 5, 16)


def run(model, x, n, branches=1):
    with torch.no_grad():
        return sample(model, x, n, branches)


def test_rdt_zero_and_never_policy_are_bitwise_identical_to_the_plain_model(model, x):
    plain = run(model, x, 8, branches=2)
    for config in (cfg(residual_diff_threshold=0.0), cfg(policy="never")):
        dicache.enable(model, config)
        hooked = run(model, x, 8, branches=2)
        st = dicache.stats(model)
        dicache.disable(model)
        assert all(torch.equal(a, b) for a, b in zip(plain, hooked))
        assert st.cached_calls == 0 and st.computed_calls == 16 and st.compute_fraction == 1.0
    assert all(torch.equal(a, b) for a, b in zip(plain, run(model, x, 8, branches=2)))


def test_permissive_threshold_caches_every_step_after_warmup(model, x):
    dicache.enable(model, cfg(max_warmup_steps=2, residual_diff_threshold=1e9, max_continuous_cached_steps=-1))
    out = run(model, x, 10)
    b = dicache.stats(model).branches["cond"]
    assert b.computed_steps == [0, 1] and b.cached_steps == list(range(2, 10))
    assert set(b.reasons[s] for s in b.cached_steps) == {"diff"}
    # a cached step reuses the middle residual: the output differs from the plain model's
    dicache.disable(model)
    assert not torch.equal(out[5], run(model, x, 10)[5])


def test_max_continuous_cached_steps_bounds_each_run(model, x):
    dicache.enable(model, cfg(max_warmup_steps=1, residual_diff_threshold=1e9, max_continuous_cached_steps=2))
    run(model, x, 10)
    b = dicache.stats(model).branches["cond"]
    assert b.computed_steps == [0, 3, 6, 9] and b.cached_steps == [1, 2, 4, 5, 7, 8]
    assert b.reasons[3] == "max_continuous"


def test_max_cached_steps_bounds_the_request(model, x):
    dicache.enable(
        model, cfg(max_warmup_steps=3, residual_diff_threshold=1e9, max_continuous_cached_steps=-1, max_cached_steps=2)
    )
    run(model, x, 8)
    b = dicache.stats(model).branches["cond"]
    assert b.cached_steps == [3, 4] and b.reasons[5] == "max_cached"


def test_dynamic_and_static_masks(model, x):
    bins = dict(scm_compute_bins=[2, 1, 1], scm_cache_bins=[2, 3])  # 1 1 0 0 1 0 0 0 1
    dicache.enable(model, cfg(max_warmup_steps=0, residual_diff_threshold=1e9, max_continuous_cached_steps=1, **bins))
    with dicache.request(model, num_inference_steps=9):
        run(model, x, 9)
    b = dicache.stats(model).branches["cond"]
    # dynamic: the mask forbids steps 0,1,4,8; MC=1 still applies in between
    assert b.cached_steps == [2, 5, 7] and b.reasons[3] == "max_continuous" and b.reasons[4] == "mask"
    dicache.enable(model, cfg(max_warmup_steps=0, residual_diff_threshold=0.0, scm_policy="static", **bins))
    with dicache.request(model, num_inference_steps=9):
        run(model, x, 9)
    b = dicache.stats(model).branches["cond"]
    assert b.cached_steps == [2, 3, 5, 6, 7] and b.computed_steps == [0, 1, 4, 8]


def test_step_mask_without_step_count_is_a_clear_error(model, x):
    dicache.enable(model, cfg(scm_preset="fast"))
    with pytest.raises(ConfigError, match="needs the number of inference steps"):
        run(model, x, 4)


def manual_dbcache(model, x, n, fn, bn, cached_steps):
    """Oracle: run the stack by hand, caching exactly `cached_steps` by plain reuse."""
    blocks, L = model.blocks, len(model.blocks)
    outs, stored, diffs, r_prev = [], None, {}, None
    for s, t in enumerate(timesteps(n)):
        temb = torch.tensor([t]).reshape(-1, 1, 1)
        h0 = model.proj_in(x)
        h = h0
        for i in range(fn):
            h = blocks[i](h, temb)
        hf, r = h, h - h0
        if r_prev is not None:
            diffs[s] = ((r - r_prev).abs().mean() / r_prev.abs().mean()).item()
        if s in cached_steps:
            h = hf + stored
        else:
            r_prev = r
            for i in range(fn, L - bn):
                h = blocks[i](h, temb)
            stored = h - hf
        for i in range(L - bn, L):
            h = blocks[i](h, temb)
        out = model.proj_out(h)
        outs.append(out)
        x = x - 0.05 * out
    return outs, diffs


def test_cached_step_is_hf_plus_stored_middle_residual_then_bn_blocks(model, x):
    dicache.enable(
        model,
        cfg(
            Fn_compute_blocks=2,
            Bn_compute_blocks=1,
            max_warmup_steps=2,
            residual_diff_threshold=1e9,
            max_continuous_cached_steps=2,
        ),
    )
    got = run(model, x, 9)
    b = dicache.stats(model).branches["cond"]
    with torch.no_grad():
        expected, diffs = manual_dbcache(model, x, 9, 2, 1, set(b.cached_steps))
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    # every measured diff is mean|r - r_prev| / mean|r_prev| against the last COMPUTED step's Fn residual
    assert b.diffs and all(abs(b.diffs[s] - diffs[s]) < 1e-5 for s in b.diffs)


def test_threshold_comparison_is_strict(model, x):
    dicache.enable(model, cfg(max_warmup_steps=1, residual_diff_threshold=1e9, max_continuous_cached_steps=-1))
    run(model, x, 3)
    measured = dicache.stats(model).branches["cond"].diffs[1]
    dicache.enable(model, cfg(max_warmup_steps=1, residual_diff_threshold=measured, max_continuous_cached_steps=-1))
    run(model, x, 3)
    b = dicache.stats(model).branches["cond"]
    assert b.diffs[1] == measured and 1 in b.computed_steps
    dicache.enable(
        model, cfg(max_warmup_steps=1, residual_diff_threshold=measured * (1 + 1e-6), max_continuous_cached_steps=-1)
    )
    run(model, x, 3)
    assert 1 in dicache.stats(model).branches["cond"].cached_steps


def test_drift_is_measured_since_the_last_full_computation(model, x):
    dicache.enable(model, cfg(max_warmup_steps=1, residual_diff_threshold=1e9, max_continuous_cached_steps=-1))
    run(model, x, 6)
    diffs = dicache.stats(model).branches["cond"].diffs
    # the reference stays the step-0 residual while steps are cached, so the drift grows monotonically here
    assert [diffs[s] for s in range(1, 6)] == sorted(diffs[s] for s in range(1, 6))


def test_taylorseer_extrapolates_a_linear_middle_residual_exactly():
    torch.manual_seed(3)
    model = ToyTransformer(num_blocks=5, dim=8, block=LinearInTimeBlock).eval()
    x = torch.randn(1, 3, 8)
    plain = run(model, x, 8)
    base = dict(max_warmup_steps=3, residual_diff_threshold=1e9, max_continuous_cached_steps=-1)
    dicache.enable(model, cfg(enable_taylorseer=True, taylorseer_order=1, **base))
    seer = run(model, x, 8)
    assert dicache.stats(model).branches["cond"].cached_steps == [3, 4, 5, 6, 7]
    dicache.enable(model, cfg(**base))
    reuse = run(model, x, 8)
    for s in range(3, 8):
        torch.testing.assert_close(seer[s], plain[s], rtol=1e-5, atol=1e-5)
    assert max((reuse[s] - plain[s]).abs().max().item() for s in range(3, 8)) > 1e-2


def test_corrected_forecaster_extrapolates_a_linear_middle_residual_exactly_through_the_engine():
    torch.manual_seed(3)
    model = ToyTransformer(num_blocks=5, dim=8, block=LinearInTimeBlock).eval()
    x = torch.randn(1, 3, 8)
    plain = run(model, x, 8)
    base = dict(max_warmup_steps=3, residual_diff_threshold=1e9, max_continuous_cached_steps=-1)
    dicache.enable(model, cfg(enable_taylorseer=True, taylorseer_damping=0.5, forecaster="corrected", **base))
    corrected = run(model, x, 8)  # 3 warm-up steps: the gain is fitted to 1 at step 2, undoing the damping
    assert dicache.stats(model).branches["cond"].cached_steps == [3, 4, 5, 6, 7]
    for s in range(3, 8):
        torch.testing.assert_close(corrected[s], plain[s], rtol=1e-5, atol=1e-5)


def test_input_corrected_forecaster_follows_the_segment_input_exactly_through_the_hook():
    torch.manual_seed(5)
    model = ToyTransformer(num_blocks=5, dim=8, block=ScaleBlock).double().eval()
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    plain = run(model, x, 8)
    base = dict(max_warmup_steps=3, residual_diff_threshold=1e9, max_continuous_cached_steps=-1)
    outputs = {}
    for forecaster in ("corrected", "input_corrected"):
        dicache.enable(model, cfg(enable_taylorseer=True, taylorseer_damping=0.5, forecaster=forecaster, **base))
        outputs[forecaster] = run(model, x, 8)
        assert dicache.stats(model).branches["cond"].cached_steps == [3, 4, 5, 6, 7]
        dicache.disable(model)
    # the middle residual is (Π(1 + k) − 1) · its input: the hook hands the input over, the coupling is fitted
    for s in range(3, 8):
        torch.testing.assert_close(outputs["input_corrected"][s], plain[s], rtol=1e-9, atol=1e-9)
    assert max((outputs["corrected"][s] - plain[s]).abs().max().item() for s in range(3, 8)) > 1e-4


def test_taylorseer_can_measure_distance_in_sigma():
    torch.manual_seed(3)
    model = ToyTransformer(num_blocks=5, dim=8, block=LinearInTimeBlock).eval()
    x = torch.randn(1, 3, 8)
    plain = run(model, x, 8)
    dicache.enable(
        model,
        cfg(
            enable_taylorseer=True,
            taylorseer_distance="sigma",
            max_warmup_steps=2,
            residual_diff_threshold=1e9,
            max_continuous_cached_steps=-1,
        ),
    )
    seer = run(model, x, 8)
    for s in range(2, 8):  # the residual is linear in the timestep itself
        torch.testing.assert_close(seer[s], plain[s], rtol=1e-5, atol=1e-5)


def test_cfg_branches_keep_separate_state(model, x):
    config = cfg(max_warmup_steps=2, residual_diff_threshold=0.3, max_continuous_cached_steps=2)
    # oracle: one enabled copy per branch, each seeing only its own calls
    cond_model, uncond_model = copy.deepcopy(model), copy.deepcopy(model)
    dicache.enable(model, config)
    both = run(model, x, 10, branches=2)
    st = dicache.stats(model)
    assert set(st.branches) == {"cond", "uncond"}
    dicache.enable(cond_model, config)
    dicache.enable(uncond_model, config)
    xx = x.clone()
    with torch.no_grad():
        for i, t in enumerate(timesteps(10)):
            oc = cond_model(xx, torch.tensor([t]))
            ou = uncond_model(xx + 0.1, torch.tensor([t]))
            assert torch.equal(oc, both[2 * i]) and torch.equal(ou, both[2 * i + 1])
            xx = xx - 0.05 * (oc + 0.5 * (ou - oc))
    assert dicache.stats(cond_model).branches["cond"].cached_steps == st.branches["cond"].cached_steps
    assert dicache.stats(uncond_model).branches["cond"].cached_steps == st.branches["uncond"].cached_steps
    assert st.branches["cond"].cached_steps, "the test needs some cached steps to mean anything"


def test_requests_with_different_step_counts_and_cfg_modes_do_not_leak(model, x):
    dicache.enable(model, cfg(max_warmup_steps=2, residual_diff_threshold=0.5, max_continuous_cached_steps=-1))
    a1 = run(model, x, 10)
    sa = dicache.stats(model)
    run(model, x * 0.5, 6, branches=2)  # a higher timestep starts a new request
    sb = dicache.stats(model)
    a2 = run(model, x, 10)
    assert all(torch.equal(p, q) for p, q in zip(a1, a2))
    assert sa is not sb and set(sa.branches) == {"cond"} and set(sb.branches) == {"cond", "uncond"}
    assert sb.branches["cond"].num_calls == 6 and sa.branches["cond"].num_calls == 10


def test_concurrent_requests_in_threads_match_sequential_runs(model, x):
    config = cfg(max_warmup_steps=2, residual_diff_threshold=0.5, max_continuous_cached_steps=2)
    dicache.enable(model, config)
    seq_a = run(model, x, 12)
    stats_a = dicache.stats(model)
    seq_b = run(model, x * 0.3, 7, branches=2)
    results, stats, errors = {}, {}, []
    barrier = threading.Barrier(2)

    def worker(name, xin, n, branches):
        try:
            barrier.wait()
            with dicache.request(model):
                results[name] = run(model, xin, n, branches)
            stats[name] = dicache.stats(model)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=a) for a in (("a", x, 12, 1), ("b", x * 0.3, 7, 2))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    assert all(torch.equal(p, q) for p, q in zip(seq_a, results["a"]))
    assert all(torch.equal(p, q) for p, q in zip(seq_b, results["b"]))
    assert stats["a"].branches["cond"].cached_steps == stats_a.branches["cond"].cached_steps
    assert set(stats["b"].branches) == {"cond", "uncond"} and stats["a"] is not stats["b"]


def test_explicit_request_and_step_api_with_named_branches(model, x):
    dicache.enable(model, cfg(max_warmup_steps=1, residual_diff_threshold=1e9, scm_preset="fast"))
    with torch.no_grad(), dicache.request(model, num_inference_steps=8):
        for i, t in enumerate(timesteps(8)):
            with dicache.step(model, i, "batched"):
                model(x, torch.tensor([t]))
    st = dicache.stats(model)
    assert list(st.branches) == ["batched"] and st.num_steps == 8
    mask = dicache.engine.policies.preset_mask("fast", 8)
    assert all(mask[s] == 0 for s in st.branches["batched"].cached_steps)


def test_per_request_overrides_and_disabled_requests(model, x):
    dicache.enable(model, cfg(max_warmup_steps=1, residual_diff_threshold=1e9, max_continuous_cached_steps=-1))
    with dicache.request(model, config={"max_warmup_steps": 4}):
        run(model, x, 6)
    assert dicache.stats(model).branches["cond"].cached_steps == [4, 5]
    plain = None
    with dicache.request(model, config={"enable_cache": False}):
        out = run(model, x, 6)
    dicache.disable(model)
    plain = run(model, x, 6)
    assert all(torch.equal(a, b) for a, b in zip(out, plain))
    with pytest.raises(ConfigError, match="unknown cache override key"):
        dicache.enable(model, {"bogus": 1})


def test_disable_restores_the_model_exactly(model):
    blocks_class = type(model.blocks)
    dicache.enable(model)
    assert "forward" in model.__dict__ and type(model.blocks) is not blocks_class
    dicache.disable(model)
    assert "forward" not in model.__dict__ and type(model.blocks) is blocks_class
    assert "_dicache_runner" not in model.blocks.__dict__ and not dicache.is_enabled(model)
    seam = SeamTransformer()
    dicache.enable(seam)
    assert "run_blocks" in seam.__dict__
    dicache.disable(seam)
    assert "run_blocks" not in seam.__dict__ and "forward" not in seam.__dict__
    assert list(model.state_dict()) == list(ToyTransformer(num_blocks=6, dim=16).state_dict())


def test_seam_and_iteration_installs_behave_the_same(model, x):
    seam = SeamTransformer(num_blocks=6, dim=16)
    seam.load_state_dict(model.state_dict())
    config = cfg(max_warmup_steps=2, residual_diff_threshold=0.4, max_continuous_cached_steps=2, Bn_compute_blocks=1)
    dicache.enable(model, config)
    dicache.enable(seam, config)
    a, b = run(model, x, 9, branches=2), run(seam, x, 9, branches=2)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert dicache.stats(model).to_dict() == dicache.stats(seam).to_dict()


def test_block_split_is_checked_at_enable(model):
    with pytest.raises(BlockSplitError, match="Fn_compute_blocks=4 \\+ Bn_compute_blocks=2 must be < the model's 6"):
        dicache.enable(model, {"Fn_compute_blocks": 4, "Bn_compute_blocks": 2})
    assert not dicache.is_enabled(model)
    dicache.enable(model, {"Fn_compute_blocks": 3, "Bn_compute_blocks": 2})
    with pytest.raises(BlockSplitError), dicache.request(model, config={"Bn_compute_blocks": 3}):
        pass


def test_dual_stream_blocks():
    torch.manual_seed(5)
    model = DualTransformer(num_blocks=5, dim=8).eval()
    h, e = torch.randn(1, 4, 8), torch.randn(1, 3, 8)

    def go():
        outs = []
        with torch.no_grad():
            for t in timesteps(6):
                outs.append(model(h, e, torch.tensor([t])))
        return outs

    plain = go()
    dicache.enable(model, cfg(residual_diff_threshold=0.0), form=DualStream())
    assert all(torch.equal(a, b) for a, b in zip(plain, go()))
    dicache.enable(
        model, cfg(max_warmup_steps=2, residual_diff_threshold=1e9, max_continuous_cached_steps=-1), form=DualStream()
    )
    cached = go()
    assert dicache.stats(model).branches["cond"].cached_steps == [2, 3, 4, 5]
    assert not torch.equal(cached[3], plain[3])
    assert len(dicache.session_of(model).active_request().branches["cond"].calibrators) == 2


def test_memory_per_branch_is_fn_residual_plus_calibrator_terms(model, x):
    for extra, expected in (({}, 2), ({"enable_taylorseer": True, "taylorseer_order": 2}, 4)):
        dicache.enable(model, cfg(max_warmup_steps=3, residual_diff_threshold=1e9, **extra))
        run(model, x, 6)
        state = dicache.session_of(model).active_request().branches["cond"]
        assert state.stored_tensors() == expected


def test_copying_an_enabled_model_is_a_clear_error(model):
    dicache.enable(model)
    with pytest.raises(TypeError, match="dicache.disable"):
        copy.deepcopy(model)


def test_a_decision_costs_at_most_one_host_read(model, x, monkeypatch):
    """Only rule 7 reads a device value, once (one `tolist` of [numerator, denominator]); nothing else syncs."""
    reads = []
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    dicache.enable(model, cfg(max_warmup_steps=2, residual_diff_threshold=0.5, max_continuous_cached_steps=2))
    with dicache.request(model), torch.no_grad():
        for i, t in enumerate(timesteps(10)):
            with dicache.step(model, i, "cond"):
                model(x, torch.tensor([t]))
    monkeypatch.undo()
    st = dicache.stats(model).branches["cond"]
    assert len(reads) == len(st.diffs) > 0 and set(reads) == {"tolist"}
    assert len(st.diffs) <= 10 - 2  # warm-up steps measure nothing


class CountingBlock(LinearInTimeBlock):
    calls = 0

    def forward(self, hidden_states, temb):
        CountingBlock.calls += 1
        return super().forward(hidden_states, temb)


def test_whole_step_reuse_with_fn_zero_runs_no_block_on_cached_steps():
    torch.manual_seed(3)
    model = ToyTransformer(num_blocks=4, dim=8, block=CountingBlock).eval()
    x = torch.randn(1, 3, 8)
    plain = run(model, x, 10)
    overrides = {"scm_preset": "curved", "scm_compute_fraction": 0.4, "scm_curve": 2.0, "scm_policy": "static"}
    dicache.enable(model, cfg(Fn_compute_blocks=0, max_warmup_steps=0, **overrides))
    CountingBlock.calls = 0
    with dicache.request(model, num_inference_steps=10):
        reused = run(model, x, 10)
    mask = dicache.engine.policies.curved_mask(10, 0.4, 2.0)
    assert CountingBlock.calls == 4 * sum(mask) == 16, "a cached step must run none of the 4 blocks"
    st = dicache.stats(model).branches["cond"]
    assert st.computed_steps == [s for s in range(10) if mask[s]] and len(st.cached_steps) == 10 - sum(mask)
    # a computed step is the plain model at the input it sees; a cached step adds the last computed stack residual
    # (t_last·Σc for these blocks) to its own embedded input
    sum_c = sum(b.c for b in model.blocks).detach()
    xs, last = x.clone(), 0
    with torch.no_grad():
        for s in range(10):
            t = 1 - s / 10
            if mask[s]:
                last = s
            expected = model.proj_out(model.proj_in(xs) + (1 - last / 10) * sum_c)
            torch.testing.assert_close(reused[s], expected, rtol=1e-5, atol=1e-5)
            if not mask[s]:
                assert not torch.allclose(reused[s], model.proj_out(model.proj_in(xs) + t * sum_c), atol=1e-4)
            xs = xs - 0.05 * reused[s]
    assert not all(torch.equal(a, b) for a, b in zip(reused, plain))


class IndexedBlock(LinearInTimeBlock):
    """Records the order in which blocks run (`IndexedBlock.ran`)."""

    ran: list[int] = []

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.index = len(IndexedBlock.ran)
        IndexedBlock.ran.append(self.index)

    def forward(self, hidden_states, temb):
        IndexedBlock.ran.append(self.index)
        return super().forward(hidden_states, temb)


def test_cached_step_blocks_still_run_and_each_skipped_run_adds_its_own_residual():
    torch.manual_seed(3)
    IndexedBlock.ran = []
    model = ToyTransformer(num_blocks=4, dim=8, block=IndexedBlock).eval()
    x = torch.randn(1, 3, 8)
    plain = run(model, x, 10)
    mask = dicache.engine.policies.curved_mask(10, 0.4, 2.0)
    static = {"scm_preset": "curved", "scm_compute_fraction": 0.4, "scm_curve": 2.0, "scm_policy": "static"}
    dicache.enable(model, cfg(Fn_compute_blocks=0, max_warmup_steps=0, cached_step_blocks="2", **static))
    IndexedBlock.ran = []
    with dicache.request(model, num_inference_steps=10):
        got = run(model, x, 10)
    expected_order = [b for s in range(10) for b in ((0, 1, 2, 3) if mask[s] else (2,))]
    assert IndexedBlock.ran == expected_order, "a cached step runs exactly the listed middle block"
    stats = dicache.stats(model)
    assert stats.blocks_run == 4 * sum(mask) + (10 - sum(mask)) and stats.to_dict()["cached_step_blocks"] == 1
    assert stats.compute_fraction == pytest.approx((4 * sum(mask) + 10 - sum(mask)) / 40)
    # residuals t·c_i do not depend on the input: blocks 0-1 and 3 add their last computed residuals (t_last), block 2
    # its fresh one (t)
    c = [b.c.detach() for b in model.blocks]
    xs, last = x.clone(), 0
    with torch.no_grad():
        for s in range(10):
            t = 1 - s / 10
            last = s if mask[s] else last
            t_last = 1 - last / 10
            expected = model.proj_out(model.proj_in(xs) + t_last * (c[0] + c[1] + c[3]) + t * c[2])
            torch.testing.assert_close(got[s], expected, rtol=1e-5, atol=1e-5)
            xs = xs - 0.05 * got[s]

    # TaylorSeer per skipped run: both runs are linear in t, so every cached step is exact
    dicache.enable(
        model,
        cfg(Fn_compute_blocks=0, max_warmup_steps=0, cached_step_blocks=[2], enable_taylorseer=True, **static),
    )
    with dicache.request(model, num_inference_steps=10):
        seer = run(model, x, 10)
    for s in range(2, 10):
        torch.testing.assert_close(seer[s], plain[s], rtol=1e-5, atol=1e-5)


def test_cached_step_blocks_are_checked_against_the_model():
    torch.manual_seed(0)
    model = ToyTransformer(num_blocks=6, dim=8).eval()
    with pytest.raises(BlockSplitError, match=r"cached_step_blocks=\[0\].*\[1, 5\)"):
        dicache.enable(model, cfg(Fn_compute_blocks=1, Bn_compute_blocks=1, cached_step_blocks=[0]))
    with pytest.raises(BlockSplitError, match="nothing is left to cache"):
        dicache.enable(model, cfg(Fn_compute_blocks=1, Bn_compute_blocks=1, cached_step_blocks="1,2,3,4"))
    with pytest.raises(ConfigError, match="more than once"):
        cfg(cached_step_blocks="2,2")
    with pytest.raises(ConfigError, match="SGLANG_CACHE_DIT_CACHED_STEP_BLOCKS='a'"):
        CacheConfig.from_env({"SGLANG_CACHE_DIT_CACHED_STEP_BLOCKS": "a"})
    assert CacheConfig.from_env({"SGLANG_CACHE_DIT_CACHED_STEP_BLOCKS": "3, 1"}).cached_step_blocks == [3, 1]
