"""The denoising loop never makes the host wait for the GPU, except where a cache decision reads its number: the
host then stays ahead and the GPU never idles between steps (CUDA's sync debug mode counts every wait)."""

import pathlib
import sys

import pytest
import torch

import dicache

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_krea2_speed import host_waits  # noqa: E402  (the benchmark's `gaps` section counts waits the same way)

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


def test_plain_denoise_never_waits_for_the_gpu(turbo):
    pipe, plan, cond, uncond, latents = turbo
    pipe.run_denoise(plan, cond, uncond, latents)  # warm: anything done once per shape is done now
    expected = pipe.run_denoise(plan, cond, uncond, latents)
    outs = []
    waits = host_waits(lambda: outs.append(pipe.run_denoise(plan, cond, uncond, latents)))
    assert waits == {}
    assert torch.equal(outs[0], expected)


def test_cached_denoise_waits_once_per_decision_at_most(turbo):
    pipe, plan, cond, uncond, latents = turbo
    dicache.enable(pipe, {"max_warmup_steps": 2, "residual_diff_threshold": 0.24})
    try:
        pipe.run_denoise(plan, cond, uncond, latents)
        waits = host_waits(lambda: pipe.run_denoise(plan, cond, uncond, latents))
        stats = dicache.stats(pipe)
    finally:
        dicache.disable(pipe)
    decisions = plan.steps - 2  # every step after the warm-up compares the first blocks' residual once
    assert 0 < sum(waits.values()) <= decisions, (waits, stats)
