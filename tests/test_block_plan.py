"""The block plan the hook layer publishes to block observers, and the policy lookahead behind it
(docs/architecture.md §9)."""

import pytest
import torch
from toymodels import SeamTransformer, ToyTransformer, sample

import dicache
from dicache import CacheConfig
from dicache.engine.adapters import generic_spec
from dicache.engine.install import observe_blocks
from dicache.engine.policies import DBCachePolicy
from dicache.engine.policies.lookahead import BranchCounters, decide_without_diff, next_call, upcoming_decisions


class Recorder:
    """Keeps every event, and checks that each block runs only after a plan listed it."""

    def __init__(self):
        self.calls = []

    def begin_call(self, info):
        self.calls.append({"info": info, "plans": [], "ran": []})

    def plan(self, plan):
        self.calls[-1]["plans"].append(plan)

    def before_block(self, index):
        call = self.calls[-1]
        assert index in call["plans"][-1].blocks, (index, call["plans"][-1])
        call["ran"].append(index)

    def after_block(self, index):
        assert self.calls[-1]["ran"][-1] == index

    def end_call(self):
        self.calls[-1]["ended"] = True


def cfg(**kw):
    return CacheConfig.from_env({}, **kw)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return SeamTransformer(num_blocks=6, dim=8).eval()


def run(model, steps, branches=1):
    torch.manual_seed(1)
    with torch.no_grad():
        return sample(model, torch.randn(1, 3, 8), steps, branches)


def test_without_cache_every_call_plans_and_runs_all_blocks_and_observing_changes_nothing(model):
    plain = run(model, 3)
    rec = Recorder()
    stop = observe_blocks(generic_spec(model), rec)
    observed = run(model, 3)
    stop()
    assert all(torch.equal(a, b) for a, b in zip(plain, observed))
    assert len(rec.calls) == 3
    for call in rec.calls:
        (plan,) = call["plans"]
        assert plan.blocks == tuple(range(6)) and plan.complete and plan.upcoming == tuple(range(6))
        assert call["ran"] == list(range(6)) and call["ended"]
    assert "run_blocks" not in model.__dict__  # the runner is gone once nothing uses it


def test_static_mask_plans_are_complete_up_front_and_match_what_runs(model):
    rec = Recorder()
    stop = observe_blocks(generic_spec(model), rec)
    mask = {"scm_compute_bins": [2, 1, 1], "scm_cache_bins": [2, 2], "scm_policy": "static", "max_warmup_steps": 0}
    dicache.enable(model, cfg(Fn_compute_blocks=1, Bn_compute_blocks=1, **mask))
    with dicache.request(model, num_inference_steps=8):
        run(model, 8)
    computed = dicache.stats(model).branches["cond"].computed_steps
    dicache.disable(model)
    stop()
    assert computed == [0, 1, 4, 7]  # mask 11 00 1 00 1
    cached_plan, full = (0, 5), tuple(range(6))
    for step, call in enumerate(rec.calls):
        (plan,) = call["plans"]  # one plan: the whole call is known before its first block
        assert plan.complete and call["info"].step == step and call["info"].branch == "cond"
        assert plan.blocks == (full if step in computed else cached_plan) == tuple(call["ran"])
        # upcoming: the following calls' plans joined, at least one stack's worth unless the request ends
        later = [full if s in computed else cached_plan for s in range(step + 1, 8)]
        joined = tuple(i for blocks in later for i in blocks)
        assert plan.upcoming == joined[: len(plan.upcoming)]
        assert len(plan.upcoming) >= 6 or plan.upcoming == joined


def test_fn_zero_cached_steps_plan_no_block_and_lookahead_reaches_the_next_computed_step(model):
    rec = Recorder()
    stop = observe_blocks(generic_spec(model), rec)
    mask = {"scm_compute_bins": [1, 1], "scm_cache_bins": [3], "scm_policy": "static", "max_warmup_steps": 0}
    dicache.enable(model, cfg(Fn_compute_blocks=0, **mask))
    with dicache.request(model, num_inference_steps=5):
        run(model, 5)
    dicache.disable(model)
    stop()
    plans = [call["plans"][0] for call in rec.calls]
    assert [p.blocks for p in plans] == [tuple(range(6)), (), (), (), tuple(range(6))]
    assert plans[1].upcoming == tuple(range(6))  # two empty calls ahead, then step 4 computes everything
    assert plans[4].upcoming == ()  # the last step: nothing follows


def test_dynamic_policy_publishes_the_fn_blocks_then_the_rest_after_deciding(model):
    rec = Recorder()
    stop = observe_blocks(generic_spec(model), rec)
    dicache.enable(
        model, cfg(Fn_compute_blocks=2, max_warmup_steps=2, residual_diff_threshold=1e9, max_continuous_cached_steps=2)
    )
    run(model, 7)
    st = dicache.stats(model).branches["cond"]
    dicache.disable(model)
    stop()
    assert st.computed_steps == [0, 1, 4] and st.cached_steps == [2, 3, 5, 6]
    for step, call in enumerate(rec.calls):
        ran = tuple(call["ran"])
        if step < 2 or step == 4:  # warm-up and the MC cap decide without a diff: known up front
            (plan,) = call["plans"]
            assert plan.complete and plan.blocks == ran == tuple(range(6))
        else:
            first, second = call["plans"]
            assert first.blocks == (0, 1) and not first.complete and first.upcoming == (0, 1)
            assert second.complete and second.blocks == ran == (0, 1)
    # after step 3 (the second cached in a row, MC=2) the next call must compute: the lookahead knows it
    assert rec.calls[3]["plans"][1].upcoming[:6] == tuple(range(6))
    # warm-up step 1 computes; step 2 needs a diff: upcoming = step 2's Fn blocks only
    assert rec.calls[1]["plans"][0].upcoming == (0, 1)


def test_cfg_branches_alternate_in_the_lookahead(model):
    rec = Recorder()
    stop = observe_blocks(generic_spec(model), rec)
    mask = {"scm_compute_bins": [1, 1], "scm_cache_bins": [1], "scm_policy": "static", "max_warmup_steps": 0}
    dicache.enable(model, cfg(**mask))
    with dicache.request(model, num_inference_steps=3):
        run(model, 3, branches=2)
    dicache.disable(model)
    stop()
    infos = [(c["info"].step, c["info"].branch) for c in rec.calls]
    assert infos == [(0, "cond"), (0, "uncond"), (1, "cond"), (1, "uncond"), (2, "cond"), (2, "uncond")]
    # at (1, cond), the order cond, uncond is known: next is (1, uncond) cached (block 0), then step 2 computes
    assert rec.calls[2]["plans"][0].upcoming == (0,) + tuple(range(6))


def test_observers_follow_a_model_that_loops_over_its_list_without_a_seam():
    torch.manual_seed(0)
    loop = ToyTransformer(num_blocks=3, dim=8).eval()
    plain = run(loop, 2)
    rec = Recorder()
    stop = observe_blocks(generic_spec(loop), rec)
    observed = run(loop, 2)
    stop()
    assert all(torch.equal(a, b) for a, b in zip(plain, observed))
    assert [call["ran"] for call in rec.calls] == [[0, 1, 2], [0, 1, 2]] and all(c["ended"] for c in rec.calls)
    assert "forward" not in loop.__dict__ and type(loop.blocks) is torch.nn.ModuleList


def test_cache_and_observer_attach_and_detach_in_any_order(model):
    plain = run(model, 4)
    spec = generic_spec(model)
    rec = Recorder()
    dicache.enable(model, cfg(policy="never"))
    stop = observe_blocks(spec, rec)
    dicache.disable(model)  # the observer keeps the runner
    assert all(torch.equal(a, b) for a, b in zip(plain, run(model, 4)))
    assert len(rec.calls) == 4
    dicache.enable(model, cfg(policy="never"))
    stop()
    dicache.disable(model)
    assert "run_blocks" not in model.__dict__ and "forward" not in model.__dict__


def test_decide_without_diff_answers_only_rules_that_need_no_diff():
    policy = DBCachePolicy(warmup=2, threshold=0.2, max_continuous=1)
    warm = BranchCounters().context(step=1, num_steps=10)
    assert decide_without_diff(policy, warm).reason == "warmup"
    ready = BranchCounters(has_residual=True, has_reference=True)
    assert decide_without_diff(policy, ready.context(step=5, num_steps=10)) is None
    capped = BranchCounters(cached_total=1, continuous_cached=1, has_residual=True, has_reference=True)
    assert decide_without_diff(policy, capped.context(step=5, num_steps=10)).reason == "max_continuous"


def test_upcoming_decisions_roll_counters_forward_and_stop_at_the_first_unknown():
    assert next_call(3, "cond", ["cond", "uncond"]) == (3, "uncond")
    assert next_call(3, "uncond", ["cond", "uncond"]) == (4, "cond")
    policy = DBCachePolicy(warmup=0, threshold=0.2, max_continuous=-1, mask=[1, 0, 0, 1, 0], static_mask=True)
    calls = list(upcoming_decisions(policy, {}, ["cond"], 0, "cond", False, num_steps=5))
    assert [(c.step, c.cache) for c in calls] == [(1, True), (2, True), (3, False), (4, True)]
    dynamic = DBCachePolicy(warmup=2, threshold=0.2, max_continuous=-1)
    calls = list(upcoming_decisions(dynamic, {}, ["cond"], 0, "cond", False, num_steps=5))
    assert [(c.step, c.cache) for c in calls] == [(1, False), (2, None)]


def test_cached_steps_plan_and_run_their_cached_step_blocks(model):
    rec = Recorder()
    stop = observe_blocks(generic_spec(model), rec)
    mask = {"scm_compute_bins": [1, 1], "scm_cache_bins": [2], "scm_policy": "static", "max_warmup_steps": 0}
    dicache.enable(model, cfg(Fn_compute_blocks=1, Bn_compute_blocks=1, cached_step_blocks="2,3", **mask))
    with dicache.request(model, num_inference_steps=4):
        run(model, 4)
    dicache.disable(model)
    stop()
    full, cached = tuple(range(6)), (0, 2, 3, 5)  # Fn block 0, the listed middle blocks 2 and 3, Bn block 5
    assert [tuple(call["ran"]) for call in rec.calls] == [full, cached, cached, full]
    plans = [call["plans"][0] for call in rec.calls]
    assert all(p.complete for p in plans) and [p.blocks for p in plans] == [full, cached, cached, full]
    assert plans[0].upcoming[:8] == cached + cached


def test_offload_always_runs_the_cached_step_blocks_too():
    from dicache.offload.pipeline import always_run_blocks

    assert always_run_blocks(1, 1, 6) == (0, 5)
    assert always_run_blocks(1, 1, 6, [3, 2]) == (0, 2, 3, 5)
