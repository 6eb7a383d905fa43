"""Multi-GPU Krea-2 on CPU (issues 9 and 10): gloo, forked processes, caching on, the embedded checkpoint if present.

What is proven, each split run against the single-process run of the same weights and inputs in the same process:
- Ulysses (2 processes): final latents bitwise equal, Turbo and CFG (separate cond/uncond calls with text of
  different lengths, and one batch-2 call with a key mask);
- tensor parallelism (2 processes), and TP 2 × Ulysses 2 (4 processes): final latents within float32 rounding;
- cache decisions: identical on every rank (step, cached or not, reason and the reduced diff, bit for bit), with the
  same pattern as the single process, under a threshold where the diff both caches and computes steps; without
  the reduction the ranks' diffs differ (so the test can fail).
Workers live in `parallel_workers.py`.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.distributed as dist

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import parallel_workers as pw  # noqa: E402

from dicache.commands.shared import add_parallel_arguments  # noqa: E402
from dicache.parallel import (  # noqa: E402
    ParallelConfigError,
    ParallelContext,
    check_degrees,
    check_parallel_model,
    parallelize,
    setup_from_args,
)
from dicache.parallel.context import rank_grid  # noqa: E402
from dicache.parallel.layout import TokenShareLayout  # noqa: E402
from dicache.parallel.sequence import SequenceShard  # noqa: E402

SPLIT_RUNS = ("sp", "tp", "sp_cfg_split", "sp_cfg_batched", "tp_cfg_split")
SEQUENCE_RUNS = ("sp", "sp_cfg_split", "sp_cfg_batched")
TENSOR_RUNS = ("tp", "tp_cfg_split")


@pytest.fixture(scope="module")
def tiny() -> pw.TinyModel:
    return pw.load_model()


@pytest.fixture(scope="module")
def two(tiny, tmp_path_factory):
    """Results of every 2-process scenario (one group of processes for all: start-up is the slow part)."""
    out = tmp_path_factory.mktemp("parallel2")
    pw.start(pw.two_process_worker, 2, out, tiny)
    return out


def _pattern(table: dict) -> dict:
    return {branch: [(step, cached, reason) for step, cached, reason, _ in calls] for branch, calls in table.items()}


def _assert_same_decisions(records: list[dict]) -> None:
    first = records[0]
    for rank, record in enumerate(records):
        assert record["decisions"] == first["decisions"], f"rank {rank} decided differently from rank 0"
        assert _pattern(record["decisions"]) == _pattern(record["ref_decisions"])
        for branch, calls in record["decisions"].items():
            for (_, _, _, diff), (_, _, _, ref) in zip(calls, record["ref_decisions"][branch]):
                assert (diff is None) == (ref is None)
                if diff is not None:
                    assert math.isclose(diff, ref, rel_tol=1e-5), (branch, diff, ref)


# ---------------------------------------------------------------------------------------------------------------------
# two processes


@pytest.mark.parametrize("scenario", SEQUENCE_RUNS)
def test_ulysses_output_bitwise_equal_to_one_process(two, scenario):
    for record in pw.load(two, scenario, 2):
        assert torch.equal(record["latents"], record["ref_latents"])


@pytest.mark.parametrize("scenario", TENSOR_RUNS)
def test_tensor_parallel_output_within_rounding(two, scenario):
    records = pw.load(two, scenario, 2)
    for record in records:
        # fp32 sums re-ordered by the all-reduce: errors at float32 rounding level, far inside bf16 noise (~4e-3)
        out, ref = record["latents"], record["ref_latents"]
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(records[0]["latents"], records[1]["latents"])  # all-reduced: every rank holds the same


@pytest.mark.parametrize("scenario", SPLIT_RUNS)
def test_cache_decisions_agree_on_every_rank(two, scenario):
    records = pw.load(two, scenario, 2)
    _assert_same_decisions(records)
    calls = [c for branch in records[0]["decisions"].values() for c in branch]
    threshold = records[0]["threshold"]
    assert any(cached and reason == "diff" for _, cached, reason, _ in calls), "no step was cached by the diff"
    assert any(not cached and reason == "diff" and d >= threshold for _, cached, reason, d in calls), (
        "no step was computed because of the diff"
    )


def test_unreduced_diffs_differ_between_ranks(two):
    """The negative control: each rank's own diff (no all-reduce) is not the same number, so agreement is earned."""
    first, second = (r["decisions"]["cond"] for r in pw.load(two, "sp_unreduced", 2))
    assert [d for *_, d in first if d is not None] != [d for *_, d in second if d is not None]


def test_diff_reduction_counts_replicated_prefix_once(two):
    records = pw.load(two, "reduction", 2)
    assert records[0]["reduced"] == records[1]["reduced"]
    assert math.isclose(records[0]["reduced"], records[0]["whole"], rel_tol=1e-6)


def test_lockstep_serving_runs_every_request_on_every_rank(two):
    leader, follower = pw.load(two, "lockstep", 2)
    assert leader["results"] == ["first: 2 ranks", "stopped"]
    assert leader["log"] == follower["log"] == [("first", 3), ("second", 1)]  # the abandoned one stopped together
    assert leader["closed"] and follower["closed"]
    assert leader["returned"] and not follower["returned"]


# ---------------------------------------------------------------------------------------------------------------------
# four processes: TP 2 × Ulysses 2 (issue 10)


def test_tp2_ulysses2_four_processes(tiny, tmp_path):
    pw.start(pw.four_process_worker, 4, tmp_path, tiny)
    records = pw.load(tmp_path, "tp2_sp2", 4)
    _assert_same_decisions(records)
    for record in records:
        torch.testing.assert_close(record["latents"], record["ref_latents"], rtol=1e-4, atol=1e-5)
        assert torch.equal(record["latents"], records[0]["latents"])


# ---------------------------------------------------------------------------------------------------------------------
# single process: degrees, options, model fit


def test_degrees_must_multiply_to_the_number_of_processes():
    check_degrees(4, 2, 2)
    with pytest.raises(ParallelConfigError, match=r"--tp-size 2 × --ulysses-degree 1 = 2 GPU\(s\), but 4 process"):
        check_degrees(4, 2, 1)
    with pytest.raises(ParallelConfigError, match=r"torchrun --nproc_per_node 2"):
        check_degrees(1, 1, 2)
    with pytest.raises(ParallelConfigError, match=r"--ulysses-degree=0 is invalid: must be an integer >= 1"):
        check_degrees(1, 1, 0)


def test_rank_grid_keeps_tensor_parallel_ranks_adjacent():
    assert rank_grid(2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert rank_grid(1, 4) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])


def test_options_and_single_process_setup(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    parser = argparse.ArgumentParser()
    add_parallel_arguments(parser)
    ctx = setup_from_args(parser.parse_args(["--tp-size", "1"]))
    assert isinstance(ctx, ParallelContext) and not ctx.enabled and ctx.world_size == 1
    with pytest.raises(ParallelConfigError, match="torchrun --nproc_per_node 4"):
        setup_from_args(parser.parse_args(["--tp-size", "2", "--ulysses-degree", "2"]))


def test_full_size_head_counts_fit_1_2_4():
    from dicache.models.krea2.transformer import Krea2Transformer

    with torch.device("meta"):
        model = Krea2Transformer()  # 48 query / 12 key-value heads, text 20 heads
    for tp, sp in [(1, 2), (2, 1), (1, 4), (4, 1), (2, 2)]:
        check_parallel_model(model, tp, sp)
    with pytest.raises(ParallelConfigError, match=r"20 query heads do not divide by tp 8"):
        check_parallel_model(model, 8, 1)
    with pytest.raises(ParallelConfigError, match=r"12 key/value heads do not divide by tp × ulysses = 8"):
        check_parallel_model(model, 1, 8)


def test_single_process_context_leaves_the_model_alone(tiny):
    pipe = pw.make_pipeline(tiny)
    before = {name: p.clone() for name, p in pipe.transformer.named_parameters()}
    assert parallelize(pipe.transformer, ParallelContext()) is pipe.transformer
    assert "parallel_layout" not in vars(pipe.transformer)
    assert all(torch.equal(before[name], p) for name, p in pipe.transformer.named_parameters())


def test_ulysses_needs_image_tokens_divisible_by_the_degree():
    shard = SequenceShard(None, 2, 0)
    with pytest.raises(ParallelConfigError, match="5 image tokens do not divide by --ulysses-degree 2"):
        shard.shard_image(torch.zeros(1, 5, 4), torch.zeros(5, 3), 3)


def test_layout_counts_each_element_once():
    shard = SequenceShard(None, 2, 1)
    shard.shard_image(torch.zeros(1, 8, 4), torch.zeros(8, 3), 3)  # text 3, local image share 4
    stream = torch.arange(7.0).reshape(1, 7, 1)
    assert torch.equal(TokenShareLayout(None, 0, 0, shard).counted(stream), stream)
    assert torch.equal(TokenShareLayout(None, 0, 1, shard).counted(stream), stream[:, 3:])  # prefix counted on rank 0
    assert TokenShareLayout(None, 1, 0, shard).counted(stream).numel() == 0  # a TP replica counts nothing
