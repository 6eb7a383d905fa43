"""Every registered family on diffusers' tiny configs (CPU, seconds each): `dicache.enable(pipe, SETTINGS)` caches
calls, its PSNR against the uncached images equals cache-dit 1.5.3's with the same settings (±0.1 dB; cache-dit runs
live when installed, else its figures recorded below are used), `policy="never"` and `disable` are bitwise the
uncached images. Then the family-specific behaviours issue 24 names: Flux with equally long streams, SD3 skip-layer
guidance, Wan 2.2's two transformers, ControlNet residuals, schedulers without sigmas, a wrong `form=`; and more
pipelines of registered families (Qwen-Image-Edit, HunyuanDiT PAG), the Fn residual at a list boundary before a list
that joins the streams (AuraFlow), a deep copy of an attached scheduler (LTX-2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_families import (
    CASES,
    SETTINGS,
    STEPS,
    Case,
    cache_dit_layout,
    cache_dit_psnr,
    flux,
    flux_controlnet,
    generate,
    pixart_alpha,
    psnr,
    sd3,
    wan,
)
from tiny_families_more import auraflow, hunyuan_dit_pag, qwen_image_edit, small_edit_area

import dicache
from dicache import BlockFormError
from dicache.adapters import FAMILIES, find_family
from dicache.blocks.family_docs import markdown_table
from dicache.engine.adapters.pipelines import read_schedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")

try:
    import cache_dit  # noqa: F401

    CACHE_DIT = True
except ImportError:
    CACHE_DIT = False

CACHE_DIT_PSNR = {
    "Flux.1": 52.033,
    "Flux.2": 71.458,
    "Qwen-Image": 63.460,
    "SD3 / SD3.5": 56.323,
    "Wan 2.1 / 2.2": 75.235,
    "HunyuanVideo": 43.462,
    "CogVideoX": 28.715,
    "CogView4": 41.196,
    "Lumina 2": 37.268,
    "Chroma": 49.966,
    "HiDream-I1": 45.288,
    "PixArt-α / Σ": 20.900,
    "Sana": 36.075,
    "Mochi 1": 32.817,
    "LTX-Video": 50.500,
    "CogView3-Plus": 52.319,
    "Krea-2": 61.173,
    "AuraFlow": 81.968,
    "Z-Image": 40.384,
    "HunyuanImage 2.1": 37.587,
    "Ovis-Image": 63.642,
    "Bria 3.2": 54.844,
    "PRX": 54.074,
    "ERNIE-Image": 60.135,
    "HunyuanDiT": 61.946,
    "DiT": 17.266,
    "Lumina-Next": 25.359,
    "Wan VACE": 97.872,
    "SkyReels-V2": 98.793,
    "ChronoEdit": 59.894,
    "Cosmos": 51.832,
    "Kandinsky 5": 39.836,
    "HunyuanVideo 1.5": 45.335,
    "Allegro": 13.092,
    "EasyAnimate": 39.323,
    "Stable Audio": 34.070,
    "AnyFlow": 87.771,
    "Helios": 34.707,
    "JoyImage-Edit": 35.466,
    "LTX-2": 34.695,
    "LongCat-Image": 57.414,
    "Bria-FIBO": 37.650,
    "GLM-Image": 56.253,
    "aMUSEd": 18.458,
}
"""cache-dit 1.5.3's PSNR (dB) on each case with its settings, recorded by `benchmarks/bench_families.py` for runs
without cache-dit (the `bench` extra); for a family cache-dit cannot run (`Case.cache_dit_fails`: Bria 3.2, LTX-2),
dicache's own figure in cache-dit's list layout."""


def test_registry_names_diffusers_classes_and_the_docs_table_is_current():
    import diffusers

    for family in FAMILIES:
        for name in family.pipelines + family.transformer_classes:
            assert hasattr(diffusers, name), (family.name, name)
    page = (Path(__file__).parent.parent / "docs" / "families.md").read_text()
    assert markdown_table() in page, "docs/families.md's table is stale: paste family_docs.markdown_table()"


def test_every_registered_family_has_a_case():
    assert set(CASES) == {family.name for family in FAMILIES}
    assert set(CACHE_DIT_PSNR) == set(CASES)


@pytest.mark.parametrize("family", sorted(CASES))
def test_family_caches_like_cache_dit_and_caching_nothing_is_bitwise(family):
    case: Case = CASES[family]
    pipe, kwargs = case.build()
    assert find_family(pipe.transformer).name == family
    plain = generate(pipe, kwargs)

    dicache.enable(pipe, case.settings)  # the default layout: a transformer's lists are one stack
    joined = generate(pipe, kwargs)
    stats = dicache.stats(pipe)
    assert stats.cached_calls > 0 and not torch.equal(joined, plain)
    ours = psnr(plain, joined)
    layout = cache_dit_layout(case)
    if layout:  # cache-dit caches the block lists otherwise (each on its own, or only some): compare that layout
        dicache.enable(pipe, case.settings, **layout)
        other = generate(pipe, kwargs)
        assert dicache.stats(pipe).cached_calls > 0
        ours = psnr(plain, other)

    dicache.enable(pipe, {"policy": "never"})
    assert torch.equal(generate(pipe, kwargs), plain)
    dicache.disable(pipe)
    assert torch.equal(generate(pipe, kwargs), plain)

    if case.cache_dit_fails:  # cache-dit cannot run it (checked live): our own recorded figure is the reference
        if CACHE_DIT:
            with pytest.raises((RuntimeError, TypeError)):
                cache_dit_psnr(case, pipe, kwargs, plain)
        reference = CACHE_DIT_PSNR[family]
    else:
        reference = cache_dit_psnr(case, pipe, kwargs, plain)[0] if CACHE_DIT else CACHE_DIT_PSNR[family]
    assert abs(ours - reference) <= 0.1, (family, ours, reference)
    assert abs(reference - CACHE_DIT_PSNR[family]) <= 0.1  # the recorded figures stay those of a live run


def test_pixart_alpha_and_wan21_use_their_family_entries():
    for build in (pixart_alpha, wan):
        pipe, kwargs = build()
        plain = generate(pipe, kwargs)
        dicache.enable(pipe, SETTINGS)
        generate(pipe, kwargs)
        assert dicache.stats(pipe).cached_calls > 0
        dicache.enable(pipe, {"policy": "never"})
        assert torch.equal(generate(pipe, kwargs), plain)
        dicache.disable(pipe)


# ---------------------------------------------------------------------- more pipelines of registered families
def test_qwen_image_edit_caches_like_cache_dit():
    with small_edit_area():
        pipe, kwargs = qwen_image_edit()  # the input image's latents join the image stream
        plain = generate(pipe, kwargs)
        dicache.enable(pipe, SETTINGS)
        cached = generate(pipe, kwargs)
        assert dicache.stats(pipe).cached_calls > 0
        dicache.enable(pipe, {"policy": "never"})
        assert torch.equal(generate(pipe, kwargs), plain)
        dicache.disable(pipe)
        assert torch.equal(generate(pipe, kwargs), plain)
        reference = cache_dit_psnr(CASES["Qwen-Image"], pipe, kwargs, plain)[0] if CACHE_DIT else 56.698
    assert abs(psnr(plain, cached) - reference) <= 0.1 and abs(reference - 56.698) <= 0.1


def test_hunyuan_dit_pag_caches_and_caching_nothing_is_bitwise():
    pipe, kwargs = hunyuan_dit_pag()  # perturbed attention on block 1, three copies per batched call
    plain = generate(pipe, kwargs)
    assert psnr(plain, generate(pipe, {**kwargs, "pag_scale": 0.0})) < 40  # the perturbed branch matters
    dicache.enable(pipe, SETTINGS)
    generate(pipe, kwargs)
    assert dicache.stats(pipe).cached_calls > 0
    dicache.enable(pipe, {"policy": "never"})
    assert torch.equal(generate(pipe, kwargs), plain)
    dicache.disable(pipe)
    assert torch.equal(generate(pipe, kwargs), plain)


# ---------------------------------------------------------------------- Fn ending at a list boundary
@pytest.mark.parametrize("fn", [1, 2], ids=["Fn-ends-at-the-boundary", "Fn-spans-it"])
def test_fn_residual_stays_in_its_list_when_the_next_list_joins_the_streams(fn):
    # AuraFlow: one MMDiT block `(h, e) -> (e, h)`, then single blocks on the joined text + image stream. The Fn
    # residual is taken on what the last Fn block returned, never against the next list's (longer) joined stream.
    pipe, kwargs = auraflow()
    plain = generate(pipe, kwargs)
    form = {"joint_transformer_blocks": "(h, e) -> (e, h)", "single_transformer_blocks": "h -> h"}
    dicache.enable(pipe, {"residual_diff_threshold": 0.95, "max_warmup_steps": 1, "Fn_compute_blocks": fn}, form=form)
    cached = generate(pipe, kwargs)
    assert dicache.stats(pipe).cached_calls > 0 and 30 < psnr(plain, cached) < float("inf")
    dicache.disable(pipe)


# ---------------------------------------------------------------------- Flux: two lists, equal stream lengths
def single_block_runs(pipe):
    counts = [0]
    for block in pipe.transformer.single_transformer_blocks:
        block.register_forward_pre_hook(lambda *a: counts.__setitem__(0, counts[0] + 1))
    return counts


def test_flux_with_equally_long_streams_caches_both_lists_as_one_stack():
    pipe, kwargs = flux(text_len=64)  # 64 text tokens, 16 × 16 image tokens at ×1: both streams 64 long
    assert kwargs["prompt_embeds"].shape[1] == (kwargs["height"] * kwargs["width"]) // 4
    plain = generate(pipe, kwargs)
    runs = single_block_runs(pipe)
    dicache.enable(pipe, SETTINGS)
    cached = generate(pipe, kwargs)
    stats = dicache.stats(pipe)
    calls = stats.cached_calls + stats.computed_calls
    assert stats.cached_calls > 0 and calls == 2 * STEPS
    # a cached call runs none of the single-stream blocks: each of the 3 ran once per computed call only
    assert runs[0] == 3 * stats.computed_calls < 3 * calls
    reference = cache_dit_psnr(CASES["Flux.1"], pipe, kwargs, plain)[0] if CACHE_DIT else None
    dicache.disable(pipe)
    if reference is not None:
        dicache.enable(pipe, SETTINGS)
        assert abs(psnr(plain, generate(pipe, kwargs)) - reference) <= 0.1
    dicache.enable(pipe, {"policy": "never"})
    assert torch.equal(generate(pipe, kwargs), plain)
    dicache.disable(pipe)
    assert torch.equal(generate(pipe, kwargs), plain) and not torch.equal(cached, plain)


@pytest.mark.parametrize("text_len", [64, 16], ids=["equal-lengths", "unequal-lengths"])
def test_a_wrong_form_on_flux_is_a_dicache_error_at_the_first_call_never_an_image(text_len):
    pipe, kwargs = flux(text_len=text_len)
    dicache.enable(pipe, SETTINGS, form="(h, e) -> (h, e)")  # diffusers' MMDiT blocks return (e, h)
    with pytest.raises(BlockFormError) as error:
        generate(pipe, kwargs)
    message = str(error.value)
    assert "FluxTransformer2DModel.transformer_blocks[0]" in message and "'(h, e) -> (h, e)'" in message
    assert "The Flux.1 entry's form for transformer_blocks ('(h, e) -> (e, h)') fits" in message
    dicache.disable(pipe)


# ---------------------------------------------------------------------- SD3: skip layers, a last block without text
def block_runs(blocks):
    counts = [0] * len(blocks)
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda *a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def test_sd3_skip_layer_guidance_is_bitwise_under_never_and_skips_the_named_blocks():
    guidance = dict(skip_guidance_layers=[1, 2], skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0)
    pipe, kwargs = sd3(**guidance)
    plain = generate(pipe, kwargs)
    dicache.enable(pipe, {"policy": "never"})
    runs = block_runs(pipe.transformer.transformer_blocks)
    assert torch.equal(generate(pipe, kwargs), plain)
    slg_calls = STEPS - 1  # steps 1..7 add a skip-layer call (step 0 is not above start · steps)
    assert runs == [STEPS + slg_calls, STEPS, STEPS, STEPS + slg_calls]
    dicache.enable(pipe, SETTINGS)
    generate(pipe, kwargs)
    branches = dicache.stats(pipe).branches  # the skip-layer call is the second call of a step: its own branch
    assert set(branches) == {"cond", "uncond"} and branches["uncond"].cached_steps
    dicache.disable(pipe)
    assert torch.equal(generate(pipe, kwargs), plain)


@pytest.mark.parametrize("bn", [0, 1])
def test_sd3_last_block_returning_no_text_stream_caches_with_and_without_bn(bn):
    pipe, kwargs = sd3()
    assert pipe.transformer.transformer_blocks[-1].context_pre_only  # returns (None, h)
    plain = generate(pipe, kwargs)
    dicache.enable(pipe, {**SETTINGS, "Bn_compute_blocks": bn})
    cached = generate(pipe, kwargs)
    assert dicache.stats(pipe).cached_calls > 0 and psnr(plain, cached) > 30
    dicache.disable(pipe)


# ---------------------------------------------------------------------- Wan 2.2: two transformers
def test_wan22_transformers_each_have_their_own_state_warmup_and_stats():
    pipe, kwargs = CASES["Wan 2.1 / 2.2"].build()
    dicache.enable(pipe, SETTINGS)
    generate(pipe, kwargs)
    high, low = dicache.stats(pipe.transformer), dicache.stats(pipe.transformer_2)
    assert dicache.stats(pipe) is high
    for stats in (high, low):  # both count their own steps from 0, each warms up on its own first step
        assert set(stats.branches) == {"cond", "uncond"}
        for branch in stats.branches.values():
            assert branch.reasons[0] == "warmup" and branch.cached_steps
    high_steps = len(high.branches["cond"].computed_steps) + len(high.branches["cond"].cached_steps)
    low_steps = len(low.branches["cond"].computed_steps) + len(low.branches["cond"].cached_steps)
    assert high_steps + low_steps == STEPS and high_steps > 1 and low_steps > 1
    dicache.disable(pipe)
    assert not dicache.is_enabled(pipe.transformer) and not dicache.is_enabled(pipe.transformer_2)


# ---------------------------------------------------------------------- ControlNet residuals, by block index
def test_flux_controlnet_residuals_keep_their_blocks():
    pipe, kwargs = flux_controlnet()
    plain = generate(pipe, kwargs)
    assert psnr(plain, generate(pipe, {**kwargs, "controlnet_conditioning_scale": 0.0})) < 40  # the residuals matter
    dicache.enable(pipe, {"policy": "never"})
    assert torch.equal(generate(pipe, kwargs), plain)
    dicache.enable(pipe, SETTINGS)
    cached = generate(pipe, kwargs)
    assert dicache.stats(pipe).cached_calls > 0 and psnr(plain, cached) > 30
    dicache.disable(pipe)
    assert torch.equal(generate(pipe, kwargs), plain)


# ---------------------------------------------------------------------- step sources
def test_schedulers_without_sigmas_or_step_index_fall_back_to_timesteps():
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

    flow = FlowMatchEulerDiscreteScheduler()
    flow.set_timesteps(4)
    count, sigmas, key = read_schedule(flow)
    assert count == 4 and sigmas == pytest.approx([float(s) for s in flow.sigmas[:4]]) and key() == sigmas[0]
    ddim = DDIMScheduler()
    ddim.set_timesteps(4)
    count, sigmas, key = read_schedule(ddim)
    assert count == 4 and sigmas is None and key is None  # no sigmas, no step index: the forward's timestep
    dpm = DPMSolverMultistepScheduler()
    dpm.set_timesteps(4)
    count, sigmas, key = read_schedule(dpm)
    assert count == 4 and len(sigmas) == 4 and key() == sigmas[0]


def test_a_deep_copy_of_an_attached_scheduler_sets_its_own_timesteps():
    import copy

    pipe, kwargs = flux()
    dicache.enable(pipe, SETTINGS)
    twin = copy.deepcopy(pipe.scheduler)  # what LTX-2 does for its audio latents
    twin.set_timesteps(3)
    pipe.scheduler.set_timesteps(5)
    assert len(twin.timesteps) == 3 and len(pipe.scheduler.timesteps) == 5
    generate(pipe, kwargs)
    assert dicache.stats(pipe).cached_calls > 0
    dicache.disable(pipe)
    assert "set_timesteps" not in pipe.scheduler.__dict__
