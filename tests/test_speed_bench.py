"""The full-size speed benchmark's bookkeeping, on the tiny model: equal work under a mask, FLOP accounting."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_krea2_speed  # noqa: E402

import dicache  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    args = bench_krea2_speed.parse_args(["--tiny", "--device", "cpu", "--no-diffusers", "--reps", "1"])
    bench = bench_krea2_speed.Bench(args)
    bench.setup()
    return bench


def test_masks_section_computes_exactly_the_mask(bench):
    bench.section_masks("")
    rows = bench.results["sections"]["masks"]
    assert {r["preset"] for r in rows} == set(bench_krea2_speed.PRESETS)
    for row in rows:
        branches = 2 if row["cfg"] else 1
        # W=0: the mask alone decides, so both implementations run the same steps (cache-dit follows its mask)
        assert row["ours_computed_calls"] == row["mask"].count("1") * branches, row


def test_run_flops_of_an_all_computed_run_equals_the_plain_count(bench):
    dicache.enable(bench.pipe, {"max_warmup_steps": 0, "residual_diff_threshold": 0.0})  # RDT 0: always compute
    try:
        bench.ours_run(6, True)()
        stats = dicache.stats(bench.pipe)
    finally:
        dicache.disable(bench.pipe)
    assert stats.cached_calls == 0 and stats.computed_calls == 12
    assert bench.run_flops(stats) == pytest.approx(bench.plain_flops(6, True))


def test_run_flops_of_cached_calls_count_only_the_fn_blocks(bench):
    config = {"scm_compute_bins": [1], "scm_cache_bins": [5], "scm_policy": "static", "max_warmup_steps": 0}
    dicache.enable(bench.pipe, config)
    try:
        bench.ours_run(6, False)()
        stats = dicache.stats(bench.pipe)
    finally:
        dicache.disable(bench.pipe)
    assert (stats.computed_calls, stats.cached_calls) == (1, 5)  # the mask 100000
    plain = bench.plain_flops(6, False)
    middle = (bench.config["num_layers"] - 1) * bench_krea2_speed.block_flops(
        bench.config, bench.image_tokens + bench.valid
    )
    assert bench.run_flops(stats) == pytest.approx(plain - 5 * middle)


def test_timeline_counts_the_union_of_kernels_and_names_the_largest_gaps():
    kernels = [
        (0.0, 100.0, "gemm"),
        (50.0, 120.0, "overlapping"),  # overlaps the first: no gap, busy 0-120
        (150.0, 200.0, "norm"),  # a 30 us gap
        (1200.0, 1300.0, "attention"),  # a 1000 us gap
        (1305.0, 1310.0, "tail"),  # 5 us: under the 20 us count
    ]
    result = bench_krea2_speed.timeline(list(reversed(kernels)), top=2)
    assert result["span_ms"] == pytest.approx(1.31)
    assert result["busy_ms"] == pytest.approx((120 + 50 + 100 + 5) / 1e3)
    assert result["idle_ms"] == pytest.approx((30 + 1000 + 5) / 1e3)
    assert result["gaps_over_20us"] == 2
    assert result["largest_gaps"] == ["1000: norm -> attention", "30: overlapping -> norm"]


def test_timeline_refuses_an_empty_profile():
    with pytest.raises(ValueError, match="no kernels"):
        bench_krea2_speed.timeline([])


def test_host_wait_filter_counts_waits_not_the_sync_debug_modes_notice():
    import warnings

    def message(text):
        return warnings.WarningMessage(UserWarning(text), UserWarning, "x.py", 1)

    assert bench_krea2_speed.is_host_wait(message("called a synchronizing CUDA operation"))
    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    assert not bench_krea2_speed.is_host_wait(message(notice))
