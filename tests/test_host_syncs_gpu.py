"""The denoising loop never makes the host wait for the GPU, except where a cache decision reads its number: the
host then stays ahead and the GPU never idles between steps (CUDA's sync debug mode counts every wait)."""

import warnings

import pytest
import torch

import dicache

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def turbo():
    """The embedded pipeline on the GPU, with a Turbo call's plan, conditioning and starting noise made once."""
    from dicache.models.krea2 import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained(device="cuda")
    pipe.set_progress_bar_config(disable=True)
    plan = pipe.plan_call(1, num_inference_steps=8, guidance_scale=1.0, output_type="latent", variant="turbo")
    with torch.no_grad():
        cond, uncond = pipe.condition(plan, ["a red apple"])
    latents = pipe.starting_latents(plan, seed=0)
    torch.cuda.synchronize()
    return pipe, plan, cond, uncond, latents


def host_waits(run) -> tuple[torch.Tensor, list[str]]:
    """`run()`'s result and where it made the host wait for the GPU (`file:line` of the Python caller, per wait)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the mode's one-time notice ("... synchronizing operations") is not a wait
    return out, [
        f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing CUDA operation" in str(w.message)
    ]


def test_plain_denoise_never_waits_for_the_gpu(turbo):
    pipe, plan, cond, uncond, latents = turbo
    pipe.run_denoise(plan, cond, uncond, latents)  # warm: anything done once per shape is done now
    expected = pipe.run_denoise(plan, cond, uncond, latents)
    out, waits = host_waits(lambda: pipe.run_denoise(plan, cond, uncond, latents))
    assert waits == []
    assert torch.equal(out, expected)


def test_cached_denoise_waits_once_per_decision_at_most(turbo):
    pipe, plan, cond, uncond, latents = turbo
    dicache.enable(pipe, {"max_warmup_steps": 2, "residual_diff_threshold": 0.24})
    try:
        pipe.run_denoise(plan, cond, uncond, latents)
        _, waits = host_waits(lambda: pipe.run_denoise(plan, cond, uncond, latents))
        stats = dicache.stats(pipe)
    finally:
        dicache.disable(pipe)
    decisions = plan.steps - 2  # every step after the warm-up compares the first blocks' residual once
    assert 0 < len(waits) <= decisions, (waits, stats)
