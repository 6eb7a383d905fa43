"""FlowMatchEulerScheduler against diffusers' FlowMatchEulerDiscreteScheduler as the Krea-2 pipeline drives it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dicache.models.krea2.scheduler import TURBO_MU, FlowMatchEulerScheduler
from dicache.models.loading import CheckpointError

diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift  # noqa: E402

KREA2_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 6400,
    "time_shift_type": "exponential",
}


def reference_scheduler(mu: float, num_steps: int, config=KREA2_SCHEDULER_CONFIG):
    """The diffusers scheduler after the Krea-2 pipeline's `retrieve_timesteps(..., sigmas=linspace, mu=mu)`."""
    ref = diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    ref.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    ref.set_begin_index(0)
    return ref


def pipeline_mu(ref, image_seq_len: int) -> float:
    c = ref.config
    return calculate_shift(image_seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)


@pytest.mark.parametrize("num_steps", [1, 2, 8, 28, 50])
@pytest.mark.parametrize("image_seq_len", [64, 256, 1024, 4096, 6400, 9216])
def test_sigmas_and_timesteps_match_reference(num_steps, image_seq_len):
    ours = FlowMatchEulerScheduler.from_config(KREA2_SCHEDULER_CONFIG)
    mu = pipeline_mu(diffusers.FlowMatchEulerDiscreteScheduler.from_config(KREA2_SCHEDULER_CONFIG), image_seq_len)
    assert ours.mu_for(image_seq_len) == mu

    for mu_arg, ref_mu in ((None, mu), (TURBO_MU, 1.15)):
        ref = reference_scheduler(ref_mu, num_steps)
        sigmas = ours.sigmas_for(num_steps, image_seq_len, mu=mu_arg)
        assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps + 1,)
        assert torch.equal(sigmas, ref.sigmas)
        assert torch.equal(ours.timesteps(sigmas), ref.timesteps)
        # the pipeline feeds `t / num_train_timesteps` to the transformer
        assert torch.equal(ours.model_timesteps(sigmas), ref.timesteps / ref.config.num_train_timesteps)


def test_schedule_shape_and_shift_endpoints():
    sched = FlowMatchEulerScheduler()
    assert sched.mu_for(256) == pytest.approx(0.5) and sched.mu_for(6400) == pytest.approx(1.15)
    assert sched.mu_for(4096) == pytest.approx(0.5 + 0.65 * (4096 - 256) / 6144)
    sigmas = sched.sigmas_for(28, 4096)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert bool((sigmas[1:] < sigmas[:-1]).all())
    # a larger shift keeps more steps at high noise
    assert bool((sched.sigmas_for(28, mu=1.15)[1:-1] > sched.sigmas_for(28, mu=0.5)[1:-1]).all())
    with pytest.raises(ValueError, match="image_seq_len"):
        sched.sigmas_for(8)
    with pytest.raises(ValueError, match="num_steps"):
        sched.sigmas_for(0, 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_euler_steps_match_reference(dtype):
    num_steps, seq = 8, 1024
    ours = FlowMatchEulerScheduler.from_config(KREA2_SCHEDULER_CONFIG)
    ref = reference_scheduler(ours.mu_for(seq), num_steps)
    sigmas = ours.sigmas_for(num_steps, seq)
    gen = torch.Generator().manual_seed(0)
    ref_sample = our_sample = torch.randn(2, seq, 64, generator=gen).to(dtype)
    for i, t in enumerate(ref.timesteps):
        velocity = torch.randn(2, seq, 64, generator=gen).to(dtype)
        ref_sample = ref.step(velocity, t, ref_sample, return_dict=False)[0]
        our_sample = ours.step(velocity, our_sample, sigmas[i], sigmas[i + 1])
        assert our_sample.dtype == dtype
        assert torch.equal(our_sample, ref_sample), f"step {i}"


def test_step_returns_sample_dtype_and_is_exact_euler():
    sample = torch.randn(3, 5)
    velocity = torch.randn(3, 5, dtype=torch.bfloat16)
    out = FlowMatchEulerScheduler.step(velocity, sample, 0.75, 0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, sample - 0.25 * velocity.float(), rtol=0, atol=1e-6)


def test_from_pretrained_reads_scheduler_config(tmp_path):
    ref = diffusers.FlowMatchEulerDiscreteScheduler.from_config(
        {**KREA2_SCHEDULER_CONFIG, "max_image_seq_len": 4096, "base_shift": 0.4}
    )
    ref.save_config(tmp_path / "scheduler")
    ours = FlowMatchEulerScheduler.from_pretrained(tmp_path)
    assert (ours.max_image_seq_len, ours.base_shift, ours.max_shift) == (4096, 0.4, 1.15)
    mu = pipeline_mu(ref, 2304)
    assert ours.mu_for(2304) == mu
    assert torch.equal(ours.sigmas_for(20, 2304), reference_scheduler(mu, 20, dict(ref.config)).sigmas)


@pytest.mark.parametrize(
    "override, key",
    [
        ({"use_dynamic_shifting": False}, "use_dynamic_shifting"),
        ({"time_shift_type": "linear"}, "time_shift_type"),
        ({"use_karras_sigmas": True}, "use_karras_sigmas"),
        ({"shift_terminal": 0.1}, "shift_terminal"),
        ({"stochastic_sampling": True}, "stochastic_sampling"),
    ],
)
def test_unsupported_configs_are_rejected(tmp_path, override, key):
    with pytest.raises(ValueError, match=key):
        FlowMatchEulerScheduler.from_config({**KREA2_SCHEDULER_CONFIG, **override})
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({**KREA2_SCHEDULER_CONFIG, **override}))
    with pytest.raises(CheckpointError, match=key):
        FlowMatchEulerScheduler.from_pretrained(tmp_path)
