"""Layerwise offload on the tiny Krea-2 model (CPU): bitwise equal to the resident run with caching off and on, and
only the blocks a call runs are copied (counted)."""

import pytest
import torch

import dicache
from dicache.errors import MemoryBudgetError
from dicache.models.krea2.memory import memory_needs
from dicache.models.krea2.pipeline import Krea2Pipeline
from dicache.models.krea2.tiny import random_tiny_transformer, tiny_transformer_config
from dicache.offload.plan import GiB
from dicache.settings.cache_config import CacheConfig
from dicache.tuning import RECOMMENDED_FAMILY

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZE, STEPS, NUM_BLOCKS = 64, 10, 6
DYNAMIC = {"Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "max_warmup_steps": 2, "residual_diff_threshold": 0.6}
CURVED = {**RECOMMENDED_FAMILY, "scm_compute_fraction": 0.4}  # docs/settings.md "Recommended settings"


def make_pipe():
    pipe = Krea2Pipeline(transformer=random_tiny_transformer(tiny_transformer_config(num_layers=NUM_BLOCKS)))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, scale=3.0, steps=STEPS, **kw):
    gen = torch.Generator().manual_seed(1)
    embeds = torch.randn(1, 12, 2, 32, generator=gen)
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[:, :5] = True
    return pipe(
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
        negative_prompt_embeds=embeds * 0.5,
        negative_prompt_embeds_mask=mask,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=scale,
        seed=0,
        output_type="latent",
        **kw,
    ).images


def budget_for(pipe, resident, cache=None, slots=2):
    """GiB that fit `resident` blocks plus the slots at the test's request size (no reserve on CPU)."""
    needs = memory_needs(pipe, SIZE, SIZE, 1, True, True, CacheConfig.from_env({}, **(cache or {})))
    blocks = sorted(needs.block_bytes)
    streamed = NUM_BLOCKS - resident
    total = needs.other_dit_bytes + sum(blocks[:resident]) + min(slots, streamed) * blocks[-1]
    return (total + needs.dit_activation_bytes + needs.cache_bytes) / GiB


def offloaded(resident, cache=None, **kw):
    pipe = make_pipe()
    if cache is not None:
        dicache.enable(pipe, cache)
    plan = pipe.enable_offload(
        dit_layerwise_offload=True,
        gpu_memory_budget=budget_for(pipe, resident, cache),
        device="cpu",
        max_height=SIZE,
        max_width=SIZE,
        **kw,
    )
    assert len(plan.resident) == resident, plan.describe()
    return pipe


def resident_run(cache=None, **kw):
    pipe = make_pipe()
    if cache is not None:
        dicache.enable(pipe, cache)
    return generate(pipe, **kw), (dicache.stats(pipe) if cache is not None else None)


def check_calls(pipe, stats=None, fn_bn=()):
    """Every call copied only blocks it ran, none late; cached calls ran only the Fn/Bn blocks."""
    record = pipe.offload.last_request
    layer = pipe.offload.layerwise
    streamed = set(layer.streamed)
    for call in record.calls:
        assert set(call.copied) <= set(call.ran) & streamed, call
        assert call.misses == 0, call  # every streamed block was prefetched before it ran
        assert call.bytes == sum(layer.packed[b].nbytes for b in call.copied)
        if stats is not None and call.step in stats.branches[call.branch].cached_steps:
            assert call.ran == list(fn_bn), call
    return record


def test_caching_off_is_bitwise_equal_and_streams_every_non_resident_block_each_call():
    ref, _ = resident_run(cfg_batched=True)
    pipe = offloaded(resident=1)
    assert pipe.offload.plan.resident == (0,) and pipe.offload.plan.num_slots == 2
    out = generate(pipe)  # CFG batched by default with layerwise offload
    assert torch.equal(out, ref)
    record = check_calls(pipe)
    assert len(record.calls) == STEPS and all(c.branch is None for c in record.calls)
    assert all(c.ran == list(range(6)) and c.copied == [1, 2, 3, 4, 5] for c in record.calls)
    per_block = pipe.offload.layerwise.packed[1].nbytes
    # caching off, nothing says the request ends: the last call also prefetched the next call's first two blocks
    assert record.blocks == (5 * STEPS + 2) * per_block
    assert pipe.offload.layerwise.totals().wasted_bytes == 0


def test_dynamic_cache_is_bitwise_equal_and_cached_steps_copy_only_their_fn_bn_blocks():
    ref, ref_stats = resident_run(DYNAMIC, cfg_batched=True)
    assert ref_stats.cached_calls >= 3  # the test needs cached steps
    pipe = offloaded(resident=0, cache=DYNAMIC)  # everything streams, Fn/Bn blocks included
    out = generate(pipe)
    stats = dicache.stats(pipe)
    assert torch.equal(out, ref) and stats.to_dict() == ref_stats.to_dict()
    record = check_calls(pipe, stats, fn_bn=(0, 5))
    cached = [c for c in record.calls if c.step in stats.branches["batched"].cached_steps]
    assert cached and all(set(c.copied) <= {0, 5} for c in cached)
    # with the Fn/Bn blocks resident (the planner's first choice) a cached step copies nothing at all
    pipe = offloaded(resident=2, cache=DYNAMIC)
    assert pipe.offload.plan.resident == (0, 5)
    assert torch.equal(generate(pipe), ref)
    record = check_calls(pipe, dicache.stats(pipe), fn_bn=(0, 5))
    assert all(c.bytes == 0 for c in record.calls if c.step in stats.branches["batched"].cached_steps)


def test_static_curved_mask_is_bitwise_equal_and_prefetches_across_skipped_steps():
    ref, ref_stats = resident_run(CURVED, cfg_batched=True)
    pipe = offloaded(resident=1, cache=CURVED)
    out = generate(pipe)
    stats = dicache.stats(pipe)
    assert torch.equal(out, ref) and stats.to_dict() == ref_stats.to_dict()
    computed = stats.branches["batched"].computed_steps
    assert len(computed) == 4  # 0.4 of 10 steps
    record = check_calls(pipe, stats, fn_bn=())  # Fn = 0: a cached step runs no block and copies nothing
    assert sum(1 for c in record.calls if c.bytes) == len(computed)
    assert pipe.offload.layerwise.totals().wasted_bytes == 0  # the lookahead copies only blocks that run


def test_separate_cfg_calls_are_bitwise_equal_to_the_same_mode_resident():
    ref, _ = resident_run(DYNAMIC, cfg_batched=False)
    pipe = offloaded(resident=1, cache=DYNAMIC)
    assert torch.equal(generate(pipe, cfg_batched=False), ref)
    branches = {c.branch for c in pipe.offload.last_request.calls}
    assert branches == {"cond", "uncond"}
    check_calls(pipe)


def test_compiled_blocks_keep_their_graphs_while_weights_stream():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    ref, _ = resident_run(DYNAMIC, cfg_batched=True)
    pipe = offloaded(resident=1, cache=DYNAMIC)
    counter = CompileCounter()
    for block in pipe.transformer.transformer_blocks:
        block.compile(backend=counter, fullgraph=True)
    assert torch.equal(generate(pipe), ref)
    warm = counter.frame_count
    assert warm > 0
    assert torch.equal(generate(pipe), ref)
    assert counter.frame_count == warm  # streamed weights change address, not shape: no recompilation
    torch._dynamo.reset()


def test_removing_offload_leaves_a_working_model():
    ref, _ = resident_run(cfg_batched=True)
    pipe = offloaded(resident=2)
    generate(pipe)
    pipe.disable_offload()
    assert pipe.offload is None and "run_blocks" not in pipe.transformer.__dict__
    assert torch.equal(generate(pipe, cfg_batched=True), ref)


def test_requests_beyond_the_plan_are_refused_before_they_start():
    pipe = offloaded(resident=2, max_images=1, cfg=True)
    with pytest.raises(ValueError, match=r"larger than the memory plan's \(4096 pixels, 1 image\(s\) per call"):
        pipe(
            prompt_embeds=torch.randn(2, 12, 2, 32),
            height=SIZE,
            width=SIZE,
            num_inference_steps=2,
            guidance_scale=1.0,
            output_type="latent",
        )
    with pytest.raises(ValueError, match="larger than the memory plan"):
        pipe(prompt_embeds=torch.randn(1, 12, 2, 32), height=2 * SIZE, width=SIZE, guidance_scale=1.0)
    assert pipe.offload.layerwise.totals().calls == 0


def test_a_budget_that_cannot_fit_fails_at_load_time_with_what_was_needed():
    pipe = make_pipe()
    with pytest.raises(MemoryBudgetError, match=r"needed \(transformer outside blocks .* available \(--gpu-memory"):
        pipe.enable_offload(dit_layerwise_offload=True, gpu_memory_budget=1e-6, device="cpu", max_height=SIZE)
    assert pipe.offload is None


def test_fp8_weights_stream_as_their_inner_tensors_and_stay_bitwise_equal():
    """Quantized weights (torchao tensor subclasses) are packed as their FP8 data and scales: fewer bytes per block,
    and the streamed model computes exactly what the resident quantized model computes."""
    pytest.importorskip("torchao")
    from torch import nn
    from torchao.quantization import Float8Tensor, PerRow

    def quantized_pipe():
        pipe = make_pipe()
        full = {name: m for name, m in pipe.transformer.named_modules() if isinstance(m, nn.Linear)}
        for name, linear in full.items():
            if name.startswith("transformer_blocks.") and ".ff." in name:
                weight = Float8Tensor.from_hp(linear.weight.detach(), granularity=PerRow())
                linear.weight = nn.Parameter(weight, requires_grad=False)
        return pipe

    bf = make_pipe()
    plain_bytes = memory_needs(bf, SIZE, SIZE, 1, True, True, CacheConfig.from_env({})).block_bytes[0]
    ref = generate(quantized_pipe(), cfg_batched=True)
    pipe = quantized_pipe()
    needs = memory_needs(pipe, SIZE, SIZE, 1, True, True, CacheConfig.from_env({}))
    assert needs.block_bytes[0] < plain_bytes  # the feed-forward weights take one byte an element, not four
    budget = needs.other_dit_bytes + 3 * max(needs.block_bytes) + needs.dit_activation_bytes + needs.cache_bytes
    plan = pipe.enable_offload(
        dit_layerwise_offload=True, gpu_memory_budget=budget / GiB, device="cpu", max_height=SIZE, max_width=SIZE
    )
    assert len(plan.streamed) == 5
    assert torch.equal(generate(pipe), ref)
    assert isinstance(pipe.transformer.transformer_blocks[3].ff.up.weight, Float8Tensor)
    check_calls(pipe)


def test_quantization_with_offload_goes_block_by_block_through_the_device(monkeypatch):
    """FP8 is made on the GPU, where the bf16 transformer need not fit: each block is quantized there on its own."""
    from dicache import quantization
    from dicache.models.krea2.memory import quantize_through_device

    pipe = make_pipe()
    expected = quantization.selected_linears(pipe.transformer, quantization.QuantizationSpec())
    calls = []

    def fake_quantize(model, spec):  # records what each call would quantize, and where the model is
        names = quantization.selected_linears(model, spec)
        calls.append(names)
        return names

    monkeypatch.setattr(quantization, "quantize_transformer", fake_quantize)
    assert quantize_through_device(pipe, "fp8", "cpu") == sorted(expected)
    assert len(calls) == NUM_BLOCKS and [n for names in calls for n in names] == expected
    assert all({name.split(".")[1] for name in names} == {str(i)} for i, names in enumerate(calls))
    assert pipe.transformer.quantization == quantization.QuantizationSpec()
