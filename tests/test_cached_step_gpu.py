"""Cached-step methods under `torch.compile` (inductor) on a CUDA GPU: once each method has run at two prompt lengths,
further requests compile nothing, even at a third length (the compiled blocks' sequence length is symbolic after two),
and the compiled results equal the eager ones within bf16 rounding. The embedded Turbo student, 8 steps at 128 px.
Run on the GPU machine: `pytest -m gpu tests/test_cached_step_gpu.py`."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import dicache
from dicache.engine.cached_step import FittedWeights, feature_width
from dicache.models.krea2 import Krea2Pipeline
from dicache.models.krea2.checkpoints import resolve_model
from dicache.tuning.masks import mask_overrides
from dicache.tuning.predictor import predictor_overrides

pytestmark = pytest.mark.gpu

MASK = (1, 1, 0, 1, 0, 1, 0, 0)


def methods(path: str) -> dict[str, dict]:
    return {
        "forecast": mask_overrides(MASK),
        "tokens 0.2": {**mask_overrides(MASK), "cached_step_method": "tokens", "cached_step_tokens": 0.2},
        "tokens 0.1": {**mask_overrides(MASK), "cached_step_method": "tokens", "cached_step_tokens": 0.1},
        "fitted": predictor_overrides(MASK, path),
    }


def generate(pipe, overrides: dict, prompt: str) -> torch.Tensor:
    dicache.enable(pipe, overrides)
    try:
        with torch.no_grad():
            return pipe(prompt, num_inference_steps=8, seed=3, output_type="latent").latents.float()
    finally:
        dicache.disable(pipe)


def test_every_method_compiles_once_and_matches_eager(tmp_path):
    torch._dynamo.reset()
    torch.manual_seed(0)
    pipe = Krea2Pipeline.from_pretrained(resolve_model(None, "turbo"), device="cuda")
    pipe.set_progress_bar_config(disable=True)
    channels = pipe.transformer.config["in_channels"]
    weights = {(s, "cond"): 0.05 * torch.randn(feature_width(channels), channels) for s in (2, 4, 6, 7)}
    weights = {
        k: w + torch.cat([torch.eye(channels), torch.zeros(4 * channels + 1, channels)]) for k, w in weights.items()
    }
    path = str(FittedWeights(8, MASK, weights).save(tmp_path / "p.safetensors"))
    eager = {name: generate(pipe, overrides, "red apple") for name, overrides in methods(path).items()}
    pipe.transformer.compile_blocks()
    for overrides in methods(path).values():  # warm-up: each method at two prompt lengths (6 and 8 text tokens)
        generate(pipe, overrides, "rocket")
        generate(pipe, overrides, "slice of pizza")
    graphs = counters["stats"]["unique_graphs"]
    compiled = {name: generate(pipe, overrides, "red apple") for name, overrides in methods(path).items()}
    assert counters["stats"]["unique_graphs"] == graphs, "a method recompiled after its warm-up"
    for name in eager:
        error = (compiled[name] - eager[name]).norm() / eager[name].norm()
        assert error < 0.05, (name, float(error))
    assert not torch.allclose(compiled["tokens 0.2"], compiled["forecast"])  # the token rows did change the result
    torch._dynamo.reset()
