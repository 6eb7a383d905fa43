"""The tiny Krea-2 configs (dicache.models.krea2.tiny): valid for the native classes, fresh per call, seeded models."""

from __future__ import annotations

import torch

from dicache.models.krea2 import tiny
from dicache.models.krea2.transformer import Krea2Transformer
from dicache.models.krea2.vae import QwenImageVAEConfig


def test_transformer_configs_build_and_take_overrides():
    configs = [
        tiny.tiny_transformer_config(),
        tiny.pipeline_transformer_config(),
        tiny.parallel_transformer_config(),
        tiny.reference_transformer_config(),
        tiny.small_transformer_config(),
    ]
    for config in configs:
        with torch.device("meta"):
            model = Krea2Transformer(**config)
        assert len(model.transformer_blocks) == config["num_layers"]
    assert tiny.reference_transformer_config(num_layers=3)["num_layers"] == 3
    assert tiny.small_transformer_config(in_channels=64)["attention_head_dim"] == 32


def test_configs_are_fresh_dicts():
    tiny.tiny_vae_config()["dim_mult"].append(4)
    tiny.tiny_text_encoder_config(10)["text_config"]["rope_parameters"]["rope_theta"] = 1.0
    assert tiny.tiny_vae_config()["dim_mult"] == [1, 2, 2]
    assert tiny.tiny_text_encoder_config(10)["text_config"]["rope_parameters"]["rope_theta"] == 10000.0
    assert QwenImageVAEConfig.from_dict(tiny.pipeline_vae_config()).scale_factor == 4


def test_random_tiny_transformer_is_seeded_and_not_identity_initialised():
    a, b = tiny.random_tiny_transformer(seed=3), tiny.random_tiny_transformer(seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not a.training and a.transformer_blocks[0].scale_shift_table.abs().sum() > 0
