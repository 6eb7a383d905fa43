"""The native Krea-2 pipeline: parity with diffusers' Krea2Pipeline on a checkpoint diffusers saved, and caching
through its explicit branch seams (Turbo and Raw)."""

import json

import numpy as np
import pytest
import torch
from tiny_krea2 import build_tiny_pipeline

import dicache
from dicache.models.krea2 import Krea2Pipeline
from dicache.models.krea2.pipeline import EMBEDDED_CHECKPOINT

SIZE = 64


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("krea2_raw")
    return d, build_tiny_pipeline(d, distilled=False)


@pytest.fixture(scope="module")
def turbo_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("krea2_turbo")
    return d, build_tiny_pipeline(d, distilled=True, seed=1)


def ours(directory):
    pipe = Krea2Pipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_ours(pipe, prompt="a red apple", steps=6, scale=2.5, seed=3, **kw):
    kw.setdefault("output_type", "np")
    return pipe(prompt, height=SIZE, width=SIZE, num_inference_steps=steps, guidance_scale=scale, seed=seed, **kw)


def run_ref(pipe, prompt="a red apple", steps=6, scale=2.5, seed=3, **kw):
    """diffusers with the same request: its guidance convention is g = s - 1 (CFG on iff g > 0)."""
    kw.setdefault("output_type", "np")
    return pipe(
        prompt,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=scale - 1.0,
        generator=torch.Generator().manual_seed(seed),
        **kw,
    )


def test_same_images_as_diffusers_raw_cfg(raw_dir):
    directory, ref = raw_dir
    pipe = ours(directory)
    a, b = run_ours(pipe).images, run_ref(ref).images
    assert a.shape == b.shape == (1, SIZE, SIZE, 3)
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    assert a.std() > 0.05 and np.isfinite(a).all()  # a real image, not a constant
    pa, pb = run_ours(pipe, output_type="pil").images[0], run_ref(ref, output_type="pil").images[0]
    assert pa.size == (SIZE, SIZE) and np.abs(np.asarray(pa, np.int16) - np.asarray(pb, np.int16)).max() <= 1


def test_same_images_as_diffusers_turbo_and_batches(turbo_dir):
    directory, ref = turbo_dir
    pipe = ours(directory)
    assert pipe.is_distilled
    a = pipe(["a red fox", "a blue car"], height=SIZE, width=SIZE, seed=5, num_images_per_prompt=2, output_type="np")
    b = ref(
        ["a red fox", "a blue car"],
        height=SIZE,
        width=SIZE,
        num_inference_steps=8,
        guidance_scale=0.0,
        generator=torch.Generator().manual_seed(5),
        num_images_per_prompt=2,
        output_type="np",
    )
    assert a.images.shape == (4, SIZE, SIZE, 3)
    np.testing.assert_allclose(a.images, b.images, atol=2e-5, rtol=0)
    assert not np.allclose(a.images[0], a.images[1])  # different noise per image


def test_same_images_as_diffusers_with_caching_under_a_forced_mask(raw_dir):
    directory, ref = raw_dir
    pipe = ours(directory)
    config = {"scm_compute_bins": [3, 1, 1], "scm_cache_bins": [2, 2], "scm_policy": "static", "max_warmup_steps": 0}
    dicache.enable(pipe, config)
    dicache.enable(ref, config)
    try:
        a = run_ours(pipe, steps=9, negative_prompt="a cat").images
        b = run_ref(ref, steps=9, negative_prompt="a cat").images
        sa, sb = dicache.stats(pipe), dicache.stats(ref)
    finally:
        dicache.disable(ref)
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    assert sa.branches["cond"].cached_steps == sb.branches["cond"].cached_steps == [3, 4, 6, 7]
    assert sa.branches["uncond"].cached_steps == sb.branches["uncond"].cached_steps == [3, 4, 6, 7]
    plain = run_ours(ours(directory), steps=9, negative_prompt="a cat").images
    assert np.abs(a - plain).max() > 1e-3  # caching changed the image: the mask really skipped blocks


def test_raw_branches_decide_like_the_diffusers_wrapper(raw_dir):
    directory, ref = raw_dir
    pipe = ours(directory)
    config = {"max_warmup_steps": 2, "residual_diff_threshold": 0.35, "max_continuous_cached_steps": 2}
    dicache.enable(pipe, config)
    dicache.enable(ref, config)
    try:
        a, b = run_ours(pipe, steps=12).images, run_ref(ref, steps=12).images
        sa, sb = dicache.stats(pipe), dicache.stats(ref)
    finally:
        dicache.disable(ref)
    assert set(sa.branches) == {"cond", "uncond"}
    for name in ("cond", "uncond"):
        assert sa.branches[name].cached_steps == sb.branches[name].cached_steps
        assert sa.branches[name].diffs.keys() == sb.branches[name].diffs.keys()
    assert sa.cached_calls > 0
    np.testing.assert_allclose(a, b, atol=5e-5, rtol=0)


def test_turbo_caches_right_after_warmup(turbo_dir):
    pipe = ours(turbo_dir[0])
    dicache.enable(pipe, {"max_warmup_steps": 2, "residual_diff_threshold": 1e9, "max_continuous_cached_steps": -1})
    pipe("a red fox", height=SIZE, width=SIZE, seed=1, output_type="latent")
    st = dicache.stats(pipe)
    assert list(st.branches) == ["cond"] and st.num_steps == 8
    assert st.branches["cond"].cached_steps == list(range(2, 8))
    dicache.disable(pipe)
    assert "request_scope" not in pipe.__dict__ and "call_scope" not in pipe.__dict__


def test_batched_cfg_matches_separate_calls(raw_dir):
    pipe = ours(raw_dir[0])
    a = run_ours(pipe, negative_prompt="a dog").images
    dicache.enable(pipe, {"residual_diff_threshold": 0.0})
    b = run_ours(pipe, negative_prompt="a dog", cfg_batched=True).images
    assert list(dicache.stats(pipe).branches) == ["batched"]
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)


def test_negative_prompt_and_outputs(raw_dir):
    pipe = ours(raw_dir[0])
    a = run_ours(pipe, output_type="latent")
    b = run_ours(pipe, negative_prompt="a green tree", output_type="latent")
    assert a.images.shape == (1, (SIZE // 8) ** 2, 64) and not torch.equal(a.images, b.images)
    pt = run_ours(pipe, output_type="pt").images
    assert pt.shape == (1, 3, SIZE, SIZE) and pt.min() >= 0 and pt.max() <= 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(height=60), "height=60 is invalid: must be a positive multiple of 8"),
        (dict(guidance_scale=0.5), "guidance_scale=0.5 is invalid: must be >= 1"),
        (dict(variant="fast"), "variant='fast' is invalid"),
        (dict(output_type="jpeg"), "output_type='jpeg' is invalid"),
        (dict(num_inference_steps=0), "num_inference_steps=0 is invalid"),
        (dict(negative_prompt=["a", "b"]), "negative_prompt has 2 entries"),
    ],
)
def test_bad_arguments_are_clear_errors(raw_dir, kwargs, message):
    pipe = ours(raw_dir[0])
    kwargs = {"height": SIZE, "width": SIZE, "num_inference_steps": 2, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipe("a red apple", **kwargs)


def test_dicache_json_sets_default_size(raw_dir):
    directory = raw_dir[0]
    (directory / "dicache.json").write_text(json.dumps({"default_size": [32, 48]}))
    try:
        out = ours(directory)("a cat", num_inference_steps=2, guidance_scale=1.0, output_type="np")
    finally:
        (directory / "dicache.json").unlink()
    assert out.images.shape == (1, 32, 48, 3)


def test_missing_embedded_checkpoint_is_a_clear_error(monkeypatch, tmp_path):
    import dicache.models.krea2.pipeline as module

    monkeypatch.setattr(module, "EMBEDDED_CHECKPOINT", tmp_path / "nothing")
    with pytest.raises(Exception, match="embedded checkpoint is missing"):
        Krea2Pipeline.from_pretrained()
    assert EMBEDDED_CHECKPOINT.name == "krea2-tiny"
