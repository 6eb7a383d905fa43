"""Memory planning, the slot schedule and the timing model of layerwise offload: pure functions, no model."""

import math

import pytest

from dicache.errors import ConfigError, MemoryBudgetError
from dicache.offload.estimate import dit_activation_bytes, vae_decode_bytes
from dicache.offload.plan import MemoryNeeds, OffloadSettings, plan_memory, prefetch_blocks, resident_layout
from dicache.offload.schedule import Copy, SlotSchedule
from dicache.offload.timeline import TraceEvent, model_time, replay

LAYERWISE = OffloadSettings(dit_layerwise_offload=True)


# ---------------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize(("value", "blocks", "expected"), [(0.0, 28, 1), (0.5, 28, 15), (1, 28, 1), (3, 28, 3)])
def test_prefetch_size_has_sglangs_meaning(value, blocks, expected):
    assert prefetch_blocks(value, blocks) == expected


def test_prefetch_size_is_capped_by_the_layers():
    assert prefetch_blocks(100, 28) == 28 and prefetch_blocks(0.99, 4) == 4


@pytest.mark.parametrize("value", [-1, 1.5, math.nan, math.inf, "2", True])
def test_bad_prefetch_size_is_a_clear_error(value):
    with pytest.raises(ConfigError, match=r"--dit-offload-prefetch-size=.* is invalid"):
        OffloadSettings(dit_layerwise_offload=True, dit_offload_prefetch_size=value)


@pytest.mark.parametrize("value", [0, -2.0, math.nan, "24"])
def test_bad_budget_is_a_clear_error(value):
    with pytest.raises(ConfigError, match=r"--gpu-memory-budget=.* is invalid: must be a number of GiB > 0"):
        OffloadSettings(gpu_memory_budget=value)


def test_bad_switch_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"--vae-cpu-offload='yes' is invalid: must be true or false"):
        OffloadSettings(vae_cpu_offload="yes")


def test_layerwise_wins_over_whole_transformer_offload_as_in_sglang():
    assert OffloadSettings(dit_layerwise_offload=True, dit_cpu_offload=True).dit_mode == "layerwise"
    assert OffloadSettings(dit_cpu_offload=True).dit_mode == "cpu"
    assert not OffloadSettings().any and OffloadSettings(gpu_memory_budget=8).any


# ---------------------------------------------------------------------------------------------------- layout
def test_layout_keeps_blocks_every_call_runs_first():
    assert resident_layout(10, (0, 9), 2) == (0, 9)
    assert resident_layout(10, (0, 9), 1) == (0,)
    assert resident_layout(10, (0,), 0) == ()
    assert resident_layout(10, (0,), 10) == tuple(range(10))


@pytest.mark.parametrize("count", range(1, 28))
def test_layout_puts_a_resident_run_before_every_streamed_block_longest_first(count):
    resident = resident_layout(28, (0,), count)
    assert len(resident) == count and 0 in resident
    streamed = [i for i in range(28) if i not in resident]
    runs, run = [], 0
    for i in range(1, 28):  # the middle: the length of each resident run ending at a streamed block
        if i in resident:
            run += 1
        else:
            runs.append(run)
            run = 0
    assert run == 0  # the last middle block is streamed: resident compute sits before streamed blocks, not after
    assert len(runs) == len(streamed)
    assert max(runs) - min(runs) <= 1 and runs == sorted(runs, reverse=True)


# ---------------------------------------------------------------------------------------------------- planning
def needs(**kw):
    base = dict(block_bytes=(100,) * 10, other_dit_bytes=50, dit_activation_bytes=30, cache_bytes=20)
    return MemoryNeeds(**{**base, **kw})


def test_unbounded_or_roomy_budget_keeps_everything_resident():
    for budget in (None, 50 + 1000 + 50):
        plan = plan_memory(needs(), LAYERWISE, budget)
        assert plan.resident == tuple(range(10)) and plan.streamed == () and plan.num_slots == 0
    assert plan.peak_bytes == 1100


def test_budget_decides_how_many_blocks_stay_and_slots_follow_the_prefetch_size():
    # always: 50 outside the blocks + r·100 resident + 2 slots·100; denoise phase 30 + 20
    plan = plan_memory(needs(), LAYERWISE, 50 + 6 * 100 + 200 + 50)
    assert len(plan.resident) == 6 and len(plan.streamed) == 4 and plan.num_slots == 2 and plan.slot_bytes == 100
    assert plan.peak_bytes == 900 and plan.parts["streamed_blocks"] == 400
    wide = plan_memory(needs(), OffloadSettings(dit_layerwise_offload=True, dit_offload_prefetch_size=2), 900)
    assert wide.num_slots == 3 and len(wide.resident) == 5


def test_slots_hold_the_largest_streamed_block_and_one_streamed_block_saves_nothing():
    sizes = (100,) * 9 + (40,)
    plan = plan_memory(needs(block_bytes=sizes), LAYERWISE, 800)
    assert plan.streamed == (2, 4, 6, 8, 9) and plan.num_slots == 2 and plan.slot_bytes == 100
    assert plan.peak_bytes == 50 + 500 + 200 + 50
    # streaming one or two blocks through as many slots saves nothing: one byte short of all resident, all stream
    tight = plan_memory(needs(block_bytes=(100,) * 3), LAYERWISE, 50 + 300 + 50 - 1)
    assert tight.resident == () and tight.num_slots == 2 and tight.peak_bytes == 300


def test_a_budget_nothing_fits_names_what_was_needed_and_what_was_available():
    with pytest.raises(MemoryBudgetError) as err:
        plan_memory(needs(shape="64x64, 2 rows"), LAYERWISE, 200, budget_source="--gpu-memory-budget 0")
    text = str(err.value)
    assert "0.29 KiB needed" in text and "0.20 KiB available (--gpu-memory-budget 0)" in text
    assert "denoise phase 50 B at 64x64, 2 rows" in text
    assert "every block streamed through 2 slot(s)" in text and "--text-encoder-cpu-offload" in text


def test_without_layerwise_offload_an_overfull_budget_suggests_it():
    with pytest.raises(MemoryBudgetError, match="--dit-layerwise-offload streams the blocks that do not fit"):
        plan_memory(needs(), OffloadSettings(), 500)


def test_offloaded_components_count_only_in_their_phase():
    kw = dict(text_encoder_bytes=400, text_encoder_activation_bytes=10, vae_bytes=5, vae_activation_bytes=90)
    on_gpu = plan_memory(needs(**kw), OffloadSettings(), None)
    assert on_gpu.always_bytes == 50 + 1000 + 400 + 5 and on_gpu.phases["decode"] == 90
    offloaded = plan_memory(needs(**kw), OffloadSettings(text_encoder_cpu_offload=True), None)
    assert offloaded.always_bytes == 50 + 1000 + 5 and offloaded.phases["encode"] == 410
    assert offloaded.peak_bytes == 1055 + 410
    whole = plan_memory(needs(**kw), OffloadSettings(dit_cpu_offload=True, text_encoder_cpu_offload=True), None)
    assert whole.always_bytes == 5 and whole.phases["denoise"] == 1050 + 50 and whole.resident == ()


def test_estimates_scale_with_rows_and_tokens():
    one = dit_activation_bytes(6144, 16384, rows=1, tokens=4144, element_bytes=2)
    assert dit_activation_bytes(6144, 16384, rows=2, tokens=4144, element_bytes=2) == 2 * one
    assert 0.5e9 < one < 2e9  # order of magnitude of one full-size call at 1024²
    small = vae_decode_bytes(16, 96, (1, 2, 4, 4), 64, 64, rows=1, element_bytes=2)
    assert vae_decode_bytes(16, 96, (1, 2, 4, 4), 128, 128, rows=1, element_bytes=2) > 4 * small * 0.9


# ---------------------------------------------------------------------------------------------------- schedule
def run_call(schedule, blocks, upcoming=()):
    """Events of one call; returns the copies issued and checks every streamed block is loaded when it runs."""
    copies = []
    schedule.begin_call()
    copies += schedule.plan(blocks, upcoming)
    for block in blocks:
        copies += schedule.before_block(block)
        assert block not in schedule.streamed or schedule.loaded(block)
        copies += schedule.after_block(block)
    copies += schedule.end_call()
    return copies


def test_a_full_call_copies_each_streamed_block_once_in_run_order():
    schedule = SlotSchedule(streamed=[2, 4, 6, 8], num_slots=2)
    copies = run_call(schedule, list(range(10)))
    assert [c.block for c in copies] == [2, 4, 6, 8]
    assert copies[:2] == [Copy(2, 0), Copy(4, 1)]  # both slots filled as soon as the plan is known
    assert copies[2].evicts == 2 and copies[3].evicts == 4


def test_cached_calls_copy_only_the_blocks_they_run():
    schedule = SlotSchedule(streamed=[0, 3, 4, 5, 9], num_slots=2)
    assert [c.block for c in run_call(schedule, [0, 9])] == [0, 9]  # Fn = Bn = 1, both streamed
    assert run_call(schedule, [0, 9]) == []  # still in their slots: nothing to copy
    schedule = SlotSchedule(streamed=[3, 4, 5], num_slots=2)
    assert run_call(schedule, [0, 9]) == []  # Fn/Bn resident: a cached call copies nothing


def test_the_next_calls_first_blocks_load_before_it_starts():
    schedule = SlotSchedule(streamed=[2, 5, 8], num_slots=2)
    full = list(range(10))
    schedule.begin_call()
    schedule.plan(full, upcoming=full)
    events = []
    for block in full:
        events += [("copy", c.block) for c in schedule.before_block(block)]
        events.append(("run", block))
        events += [("copy", c.block) for c in schedule.after_block(block)]
    # after block 5 ran its slot takes block 2 of the next call; block 8's slot takes 5 once 8 ran
    assert events.index(("copy", 2), events.index(("run", 5))) < events.index(("run", 8))
    assert [e for e in events if e[0] == "copy"][-1] == ("copy", 5)
    assert schedule.loaded(2) and schedule.loaded(5) and not schedule.loaded(8)


def test_a_block_run_without_a_plan_is_copied_on_demand():
    schedule = SlotSchedule(streamed=[1, 2], num_slots=1)
    schedule.begin_call()
    assert schedule.before_block(1) == [Copy(1, 0)]
    schedule.after_block(1)
    assert schedule.before_block(2) == [Copy(2, 0, evicts=1)]


def test_blocks_needed_sooner_are_never_evicted_for_later_ones():
    schedule = SlotSchedule(streamed=[1, 2, 3], num_slots=2)
    schedule.begin_call()
    copies = schedule.plan([1, 2, 3], upcoming=[1])
    assert copies == [Copy(1, 0), Copy(2, 1)]  # 3 must wait for a slot; the next call's 1 is already there


def test_enough_slots_keep_every_streamed_block_after_the_first_call():
    schedule = SlotSchedule(streamed=[1, 2, 3], num_slots=3)
    assert len(run_call(schedule, [0, 1, 2, 3])) == 3
    assert run_call(schedule, [0, 1, 2, 3]) == []


# ---------------------------------------------------------------------------------------------------- timeline
def test_model_time_without_copies_is_the_compute_time():
    trace = [TraceEvent("run", b) for b in range(4)] + [TraceEvent("call")]
    assert model_time(trace, block_seconds=0.5, bandwidth=1.0, call_seconds=1.0).seconds == 3.0


def test_model_time_is_bounded_by_the_copies_when_they_are_slower():
    calls = [list(range(8))] * 3
    trace = replay(calls, streamed=range(8), num_slots=2, block_bytes=lambda b: 10)
    slow = model_time(trace, block_seconds=1.0, bandwidth=1.0)  # each copy 10 s
    assert slow.copied_bytes == 8 * 10 * 3 and slow.seconds >= 8 * 10 * 3
    fast = model_time(trace, block_seconds=1.0, bandwidth=1e9)
    assert fast.seconds == pytest.approx(24.0) and fast.stall_seconds == pytest.approx(0.0, abs=1e-6)


def test_spreading_streamed_blocks_hides_copies_that_a_streamed_tail_cannot():
    # docs/architecture.md §7: a block computes in 6.4 ms and streams in 15.7 ms; 23 of 28 blocks resident, 2 slots
    calls = [list(range(28))] * 4
    bytes_per_block, bandwidth, compute = 868_000_000, 55.2e9, 0.0064
    spread = [b for b in range(28) if b not in resident_layout(28, (0,), 23)]
    tail = list(range(23, 28))
    t_spread = model_time(replay(calls, spread, 2, lambda b: bytes_per_block), compute, bandwidth)
    t_tail = model_time(replay(calls, tail, 2, lambda b: bytes_per_block), compute, bandwidth)
    assert t_spread.stall_seconds < 0.001 < t_tail.stall_seconds
    assert t_spread.seconds == pytest.approx(4 * 28 * compute, rel=0.01)
