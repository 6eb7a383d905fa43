"""Tiny Krea-2 configurations: random models small enough for CPU tests and for benchmarks' logic checks.

Transformer configs are keyword arguments of `Krea2Transformer` (and of diffusers' `Krea2Transformer2DModel`), VAE
configs those of diffusers' `AutoencoderKLQwenImage` (and of `QwenImageVAEDecoder`), the text-encoder config those of
`transformers.Qwen3VLConfig`. Every function returns a fresh dict; keyword overrides replace its entries. The embedded
checkpoint's own architecture is not here: it is part of its training recipe (scripts/train_embedded.py).
"""

from __future__ import annotations

import torch

from dicache.models.krea2.transformer import Krea2Transformer

TINY_TEXT_DIM = 32
"""Width of the tiny text encoder's hidden states (the transformers' `text_hidden_dim`)."""


def tiny_transformer_config(**overrides) -> dict:
    """4 blocks of width 64 (4 query / 2 key-value heads of 16), 16 input channels, text 32 wide from 2 layers."""
    config = dict(
        in_channels=16,
        num_layers=4,
        attention_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        timestep_embed_dim=32,
        text_hidden_dim=TINY_TEXT_DIM,
        num_text_layers=2,
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=64,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6),
    )
    config.update(overrides)
    return config


def pipeline_transformer_config(num_layers: int = 6) -> dict:
    """The tiny diffusers-layout pipeline's transformer: 64 input channels (16 latent channels × patch 2²), text from
    3 layers of the tiny text encoder."""
    return tiny_transformer_config(in_channels=64, num_layers=num_layers, intermediate_size=96, num_text_layers=3)


def parallel_transformer_config() -> dict:
    """The embedded checkpoint's head layout at tiny width (8 query / 4 key-value heads, text 4 heads): every split up
    to tensor-parallel 2 × Ulysses 2 divides them."""
    return tiny_transformer_config(
        in_channels=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=192,
        num_text_layers=3,
        text_num_attention_heads=4,
        text_num_key_value_heads=4,
    )


def reference_transformer_config(**overrides) -> dict:
    """2 blocks, 8 input channels, 2 refiner text blocks and rope_theta 1000: the base of the comparisons against
    diffusers' transformer."""
    base = dict(
        in_channels=8,
        num_layers=2,
        intermediate_size=48,
        num_text_layers=3,
        text_num_attention_heads=4,
        text_intermediate_size=40,
        num_refiner_text_blocks=2,
        rope_theta=1000.0,
    )
    return tiny_transformer_config(**{**base, **overrides})


def small_transformer_config(**overrides) -> dict:
    """Heads of 32 (4 query / 2 key-value), 4 blocks, text 64 wide from 4 layers: the benchmarks' `--tiny` model."""
    base = dict(
        attention_head_dim=32,
        intermediate_size=256,
        timestep_embed_dim=64,
        text_hidden_dim=64,
        num_text_layers=4,
        text_num_attention_heads=4,
        text_num_key_value_heads=4,
        text_intermediate_size=128,
        num_layerwise_text_blocks=2,
        num_refiner_text_blocks=2,
        axes_dims_rope=(8, 12, 12),
    )
    return tiny_transformer_config(**{**base, **overrides})


def tiny_vae_config(**overrides) -> dict:
    """×4 spatial (3 channel multipliers, one temporal down-sampling), 16 latent channels, base width 8, no attention;
    latent statistics left to the class defaults."""
    config = dict(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True],
    )
    config.update(overrides)
    return config


def pipeline_vae_config() -> dict:
    """The tiny diffusers-layout pipeline's VAE: `tiny_vae_config` with distinct per-channel latent statistics."""
    return tiny_vae_config(latents_mean=[0.1 * i for i in range(16)], latents_std=[1.0 + 0.05 * i for i in range(16)])


def tiny_text_encoder_config(vocab_size: int, num_hidden_layers: int = 3) -> dict:
    """`Qwen3VLConfig` arguments: text layers 32 wide (4 query / 2 key-value heads of 8), a one-block vision tower."""
    return dict(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=TINY_TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=TINY_TEXT_DIM,
            patch_size=4,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
    )


def randomise_tables_and_norms(model: torch.nn.Module, std: float) -> None:
    """Draw the `scale_shift_table` and norm parameters of `model` from N(0, std) in place (zero-initialised, they
    would make every block an identity)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "scale_shift_table" in name or "norm" in name:
                param.normal_(0, std)


def random_tiny_transformer(config: dict | None = None, seed: int = 0, std: float = 0.2) -> Krea2Transformer:
    """A native `Krea2Transformer(**config)` (default `tiny_transformer_config()`) in eval mode, built after
    `torch.manual_seed(seed)`, with tables and norms drawn from N(0, std)."""
    torch.manual_seed(seed)
    model = Krea2Transformer(**(config if config is not None else tiny_transformer_config())).eval()
    randomise_tables_and_norms(model, std)
    return model
