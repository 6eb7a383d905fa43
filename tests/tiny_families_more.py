"""Tiny diffusers pipelines of the families registered after the first seventeen (`tiny_families.py` has those and
merges `MORE_CASES` into its `CASES`); same conventions: diffusers' test sizes with a few more blocks, random prompt
embeddings instead of text encoders, 8 steps, decoded output in `[0, 1]`."""

from __future__ import annotations

import torch
from tiny_parts import SETTINGS, Case, common_kwargs, finish, kl_vae, randn


def auraflow():
    """AuraFlow: MMDiT blocks, then the model joins text and image for the single-stream blocks; batched CFG, 16 px
    (a ×2 VAE)."""
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    transformer = AuraFlowTransformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=1,
        num_single_dit_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        out_channels=4,
        pos_embed_max_size=256,
    )
    vae = kl_vae(
        4,
        block_out_channels=(4, 4),
        norm_num_groups=2,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )
    pipe = AuraFlowPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler()
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 32, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 8, 32, seed=2),
        negative_prompt_attention_mask=mask,
        guidance_scale=5.0,
        height=16,
        width=16,
    )
    return finish(pipe), kwargs


MORE_CASES: dict[str, Case] = {
    case.family: case
    for case in (
        Case(
            "AuraFlow",
            auraflow,
            separate_cfg=False,
            cache_dit_form={"single_transformer_blocks": "h -> h"},
            settings={**SETTINGS, "residual_diff_threshold": 0.8},  # random weights: nothing cached at 0.5
        ),
    )
}
"""The cases of `FAMILIES` entries after Krea-2, keyed by family name."""
