"""`dicache.enable` on diffusers' `Krea2Pipeline` (a pipeline we do not control): steps and branches are derived
from the scheduler's timestep; Turbo (no CFG) and Raw (CFG) must both cache correctly."""

import contextlib
import copy

import pytest
import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline
from tiny_krea2 import tiny_transformer as shared_tiny_transformer
from torch import nn

import dicache
import dicache.engine.install
from dicache import CacheConfig
from dicache.models.krea2.tiny import tiny_vae_config

TEXT = dict(num_text_layers=3, text_hidden_dim=32)


def tiny_transformer(seed=0):
    """diffusers' tiny 6-block Krea-2 transformer (`tiny_krea2`), seeded."""
    torch.manual_seed(seed)
    return shared_tiny_transformer()


def make_pipe(transformer, distilled):
    vae = AutoencoderKLQwenImage(**tiny_vae_config(dim_mult=[1, 2, 2, 2], temperal_downsample=[False, True, True]))
    vae.eval()
    sched = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400
    )
    pipe = Krea2Pipeline(
        scheduler=sched, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer, is_distilled=distilled
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def embeds(seed, valid):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(1, 12, TEXT["num_text_layers"], TEXT["text_hidden_dim"], generator=g)
    m = torch.zeros(1, 12, dtype=torch.bool)
    m[:, :valid] = True
    return e, m


def generate(pipe, steps, guidance, size=64):
    pe, pm = embeds(1, 7)
    ne, nm = embeds(2, 3)
    kw = dict(
        prompt_embeds=pe,
        prompt_embeds_mask=pm,
        height=size,
        width=size,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    )
    if guidance > 0:
        kw.update(negative_prompt_embeds=ne, negative_prompt_embeds_mask=nm)
    return pipe(**kw).images


class BranchRouter(nn.Module):
    """Test oracle: routes the k-th transformer call at each timestep to its own model copy.

    With `mix=True` every call goes to the first model as branch "cond" of one explicit request: one state shared
    by both branches, i.e. what a wrong pairing would do.
    """

    def __init__(self, models, mix=False):
        super().__init__()
        self.models = nn.ModuleList(models)
        self.config, self.dtype, self.device = models[0].config, models[0].dtype, models[0].device
        self.last, self.k, self.step, self.mix = None, 0, -1, mix
        self.scope = contextlib.ExitStack()

    def forward(self, timestep, **kwargs):
        t = float(timestep[0])
        self.k = self.k + 1 if t == self.last else 0
        self.step += self.k == 0
        self.last = t
        if not self.mix:
            return self.models[self.k](timestep=timestep, **kwargs)
        if self.step == 0 and self.k == 0:
            self.scope.enter_context(dicache.request(self.models[0]))
        with dicache.step(self.models[0], self.step, "cond"):
            return self.models[0](timestep=timestep, **kwargs)


def test_turbo_caches_right_after_warmup_without_reading_the_timestep(monkeypatch):
    pipe = make_pipe(tiny_transformer(), distilled=True)
    dicache.enable(
        pipe, CacheConfig.from_env({}, max_warmup_steps=2, residual_diff_threshold=1e9, max_continuous_cached_steps=-1)
    )

    def forbidden(value):
        raise AssertionError("the pipeline path must take the step from the scheduler, not the timestep tensor")

    monkeypatch.setattr(dicache.engine.install, "_timestep_key", forbidden)
    generate(pipe, 8, 0.0)
    st = dicache.stats(pipe)
    assert list(st.branches) == ["cond"] and st.num_steps == 8
    assert st.branches["cond"].computed_steps == [0, 1] and st.branches["cond"].cached_steps == list(range(2, 8))


def test_raw_cfg_keeps_cond_and_uncond_apart():
    config = CacheConfig.from_env({}, max_warmup_steps=2, residual_diff_threshold=0.6, max_continuous_cached_steps=2)
    transformer = tiny_transformer()
    copies = [copy.deepcopy(transformer), copy.deepcopy(transformer)]
    shared = copy.deepcopy(transformer)
    pipe = make_pipe(transformer, distilled=False)
    dicache.enable(pipe, config)
    latents = generate(pipe, 10, 3.5)
    st = dicache.stats(pipe)
    assert set(st.branches) == {"cond", "uncond"}
    assert st.branches["cond"].cached_steps and st.branches["uncond"].cached_steps
    assert st.branches["cond"].diffs != st.branches["uncond"].diffs  # each branch measures its own drift

    # oracle: each branch's calls go to its own separately enabled copy (per-branch reference residuals)
    for c in copies:
        dicache.enable(c, config)
    oracle = make_pipe(BranchRouter(copies), distilled=False)
    expected = generate(oracle, 10, 3.5)
    assert torch.equal(latents, expected)
    assert dicache.stats(copies[0]).branches["cond"].cached_steps == st.branches["cond"].cached_steps
    assert dicache.stats(copies[1]).branches["cond"].cached_steps == st.branches["uncond"].cached_steps

    # negative control: one state shared by both branches (the bug the branch split prevents) is detected
    dicache.enable(shared, config)
    mixed = make_pipe(BranchRouter([shared], mix=True), distilled=False)
    assert not torch.equal(generate(mixed, 10, 3.5), latents)


def test_threshold_zero_is_bitwise_identical_and_disable_restores_the_pipeline():
    pipe = make_pipe(tiny_transformer(), distilled=False)
    plain = generate(pipe, 6, 3.5)
    cls, set_timesteps = type(pipe), pipe.scheduler.set_timesteps
    dicache.enable(pipe, {"residual_diff_threshold": 0.0})
    assert torch.equal(generate(pipe, 6, 3.5), plain)
    assert type(pipe).__name__ == "Krea2Pipeline" and isinstance(pipe, Krea2Pipeline)
    dicache.disable(pipe)
    assert type(pipe) is cls and "set_timesteps" not in pipe.scheduler.__dict__
    assert pipe.scheduler.set_timesteps.__func__ is set_timesteps.__func__
    assert "forward" not in pipe.transformer.__dict__
    assert torch.equal(generate(pipe, 6, 3.5), plain)


@pytest.mark.parametrize("distilled, guidance", [(True, 0.0), (False, 3.5)])
def test_step_mask_preset_gets_the_step_count_from_the_pipeline(distilled, guidance):
    pipe = make_pipe(tiny_transformer(), distilled=distilled)
    dicache.enable(pipe, {"scm_preset": "fast", "scm_policy": "static", "max_warmup_steps": 0})
    generate(pipe, 12, guidance)
    st = dicache.stats(pipe)
    mask = dicache.engine.policies.preset_mask("fast", 12)
    for b in st.branches.values():
        assert b.cached_steps == [i for i, m in enumerate(mask) if m == 0]
    assert st.num_steps == 12


def test_requests_of_different_step_counts_and_modes_in_sequence():
    transformer = tiny_transformer()
    turbo, raw = make_pipe(transformer, True), make_pipe(transformer, False)
    config = {"max_warmup_steps": 2, "residual_diff_threshold": 0.6}
    dicache.enable(turbo, config)
    dicache.enable(raw, config)
    a = generate(turbo, 8, 0.0)
    sa = dicache.stats(turbo)
    generate(raw, 12, 3.5)
    sr = dicache.stats(raw)
    assert torch.equal(generate(turbo, 8, 0.0), a)
    assert set(sa.branches) == {"cond"} and set(sr.branches) == {"cond", "uncond"} and sr.num_steps == 12
    dicache.disable(raw)
    assert dicache.is_enabled(turbo.transformer)  # still used by the turbo pipeline
    dicache.disable(turbo)
    assert not dicache.is_enabled(transformer)
