"""`Krea2Pipeline.__call__`'s declared per-step seam: `callback_on_step_end` (diffusers' contract) and the stops
(`interrupt`, or an exception raised by the callback)."""

import pytest
import torch
from tiny_krea2 import build_tiny_pipeline

import dicache
from dicache.models.krea2 import Krea2Pipeline
from dicache.settings.cache_config import CacheConfig

SIZE, STEPS = 32, 4


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("krea2_callback")
    build_tiny_pipeline(directory, distilled=False)
    pipe = Krea2Pipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, **kw):
    kw.setdefault("output_type", "latent")
    return pipe("a red apple", height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=2.0, seed=1, **kw)


def count_transformer_calls(pipe):
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


def test_callback_runs_once_per_step_with_its_index_timestep_and_latents(pipe):
    seen = []

    def callback(p, step, timestep, tensors):
        seen.append((p, step, float(timestep), sorted(tensors), tensors["latents"].clone()))
        return {}

    out = generate(pipe, callback_on_step_end=callback)
    rows, cols = pipe.latent_grid(SIZE, SIZE)
    expected = pipe.scheduler.timesteps(pipe.sigmas(STEPS, rows * cols, "raw"))
    assert [s[1] for s in seen] == list(range(STEPS))
    assert [s[2] for s in seen] == [float(t) for t in expected]
    assert all(s[0] is pipe and s[3] == ["latents"] for s in seen)
    assert torch.equal(seen[-1][4], out.latents)  # the last step's latents are the output
    assert torch.equal(generate(pipe).latents, out.latents)  # a callback that changes nothing changes nothing


def test_callback_can_replace_the_latents(pipe):
    plain = generate(pipe)

    def zero_at_step_2(p, step, timestep, tensors):
        return {"latents": torch.zeros_like(tensors["latents"])} if step == 2 else {}

    out = generate(pipe, callback_on_step_end=zero_at_step_2)
    assert not torch.equal(out.latents, plain.latents)
    # the replaced latents are what step 3 starts from: the same as denoising zeros over the last step alone
    rows, cols = pipe.latent_grid(SIZE, SIZE)
    sigmas = pipe.sigmas(STEPS, rows * cols, "raw")
    cond = pipe.text_conditioning(*pipe.encode_prompt(["a red apple"]), 1)
    uncond = pipe.text_conditioning(*pipe.encode_prompt([""]), 1)
    last = pipe.denoise(cond, uncond, torch.zeros_like(out.latents), rows, cols, sigmas[3:], 2.0)
    torch.testing.assert_close(out.latents, last, rtol=0, atol=1e-6)


def test_interrupt_skips_the_remaining_steps_and_still_decodes(pipe):
    def stop_after_step_1(p, step, timestep, tensors):
        if step == 1:
            p._interrupt = True
        return {}

    calls, handle = count_transformer_calls(pipe)
    try:
        out = generate(pipe, output_type="np", callback_on_step_end=stop_after_step_1)
        assert len(calls) == 2 * 2 and pipe.interrupt  # steps 0 and 1, cond and uncond each
        assert out.images.shape == (1, SIZE, SIZE, 3)
        calls.clear()
        generate(pipe)  # the next call starts afresh
        assert len(calls) == 2 * STEPS and not pipe.interrupt
    finally:
        handle.remove()


def test_an_exception_from_the_callback_stops_the_call_before_the_vae(pipe):
    class Stop(Exception):
        pass

    def stop_at_step_0(p, step, timestep, tensors):
        raise Stop

    decoded = []
    handle = pipe.vae.register_forward_pre_hook(lambda *a: decoded.append(1))
    decoder = pipe.vae.decoder.register_forward_pre_hook(lambda *a: decoded.append(1))
    calls, counter = count_transformer_calls(pipe)
    try:
        with pytest.raises(Stop):
            generate(pipe, output_type="np", callback_on_step_end=stop_at_step_0)
        assert len(calls) == 2 and not decoded
    finally:
        for h in (handle, decoder, counter):
            h.remove()


def test_callback_survives_enabling_the_cache_twice_and_checks_its_inputs(pipe):
    steps = []
    try:
        dicache.enable(pipe, CacheConfig(enable_cache=True, max_warmup_steps=1))
        dicache.enable(pipe, CacheConfig(enable_cache=True, max_warmup_steps=1))
        generate(pipe, callback_on_step_end=lambda p, i, t, kw: steps.append(i))  # None: nothing changes
        assert steps == list(range(STEPS))
    finally:
        dicache.disable(pipe)
    with pytest.raises(ValueError, match=r"callback_on_step_end_tensor_inputs.*\['velocity'\].*\['latents'\]"):
        generate(pipe, callback_on_step_end=lambda *a: {}, callback_on_step_end_tensor_inputs=["velocity"])
