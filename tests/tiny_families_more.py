"""Tiny diffusers pipelines of the families registered after the first seventeen (`tiny_families.py` has those and
merges `MORE_CASES` into its `CASES`); same conventions: diffusers' test sizes with a few more blocks, random prompt
embeddings instead of text encoders, 8 steps, decoded output in `[0, 1]`."""

from __future__ import annotations

import torch
from tiny_parts import (
    SETTINGS,
    Case,
    common_kwargs,
    draw_zero_weights,
    finish,
    flux2_vae,
    kl_vae,
    randn,
    small_kl_vae,
)


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
    pipe = AuraFlowPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=small_kl_vae(4),
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
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


def zimage():
    """Z-Image: refiners, then one single-stream list over the joined text and image; batched CFG (a list of
    latents per call), 32 px (a ×2 VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=4,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=16,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    )
    with torch.no_grad():  # drawn with torch.empty: fixed values keep NaNs out
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=small_kl_vae(4),
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
    )
    kwargs = common_kwargs(
        prompt_embeds=[randn(8, 16, seed=1)],
        negative_prompt_embeds=[randn(8, 16, seed=2)],
        guidance_scale=3.0,
        cfg_normalization=False,
        cfg_truncation=1.0,
        height=32,
        width=32,
    )
    return finish(pipe), kwargs


def hunyuan_image_vae():
    """HunyuanImage's ×8 VAE (32 channels per level: its group norms have 32 groups)."""
    from diffusers import AutoencoderKLHunyuanImage

    torch.manual_seed(0)
    return AutoencoderKLHunyuanImage(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(32, 32, 32, 32),
        layers_per_block=1,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        sample_size=128,
    ).eval()


def hunyuan_image():
    """HunyuanImage 2.1: double- then single-stream blocks (both `(h, e) -> (h, e)`), CFG as two calls per step
    through its guider, 16 px (a ×8 VAE)."""
    from diffusers import (
        AdaptiveProjectedMixGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanImagePipeline,
        HunyuanImageTransformer2DModel,
    )

    torch.manual_seed(0)
    transformer = HunyuanImageTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=4,
        attention_head_dim=8,
        num_layers=2,
        num_single_layers=3,
        num_refiner_layers=1,
        patch_size=(1, 1),
        guidance_embeds=False,
        text_embed_dim=32,
        text_embed_2_dim=32,
        rope_axes_dim=(4, 4),
    )
    pipe = HunyuanImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        vae=hunyuan_image_vae(),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
        guider=AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=2),
        ocr_guider=AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=3),
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 32, seed=1),
        prompt_embeds_mask=mask,
        negative_prompt_embeds=randn(1, 8, 32, seed=2),
        negative_prompt_embeds_mask=mask,
        prompt_embeds_2=randn(1, 8, 32, seed=3),
        prompt_embeds_mask_2=mask,
        negative_prompt_embeds_2=randn(1, 8, 32, seed=4),
        negative_prompt_embeds_mask_2=mask,
        height=16,
        width=16,
    )
    return finish(pipe), kwargs


def ovis_image():
    """Ovis-Image: Flux-like double- then single-stream blocks (both `(h, e) -> (e, h)`), CFG as two calls per step,
    16 px (a ×1 VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, OvisImagePipeline, OvisImageTransformer2DModel

    torch.manual_seed(0)
    transformer = OvisImageTransformer2DModel(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 4, 8),
    )
    pipe = OvisImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=kl_vae(1),
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 32, seed=1),
        negative_prompt_embeds=randn(1, 8, 32, seed=2),
        negative_prompt=None,
        guidance_scale=2.0,
        height=16,
        width=16,
    )
    return finish(pipe), kwargs


def bria():
    """Bria 3.2: Flux-like double- then single-stream blocks (both `(h, e) -> (e, h)`), batched CFG, 16 px (a ×1
    VAE)."""
    from diffusers import BriaPipeline, BriaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    transformer = BriaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=None,
        axes_dims_rope=[0, 4, 4],
    )
    pipe = BriaPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=kl_vae(1),
        text_encoder=None,
        tokenizer=None,
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 32, seed=1),
        negative_prompt_embeds=randn(1, 8, 32, seed=2),
        guidance_scale=5.0,
        height=16,
        width=16,
    )
    return finish(pipe), kwargs


def prx():
    """PRX: blocks attending to the text `(h, e) -> h`, batched CFG, 16 px (a ×1 VAE). Its zero-initialised
    modulation is drawn at random (else every block returns its input)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, PRXPipeline, PRXTransformer2DModel

    torch.manual_seed(0)
    transformer = PRXTransformer2DModel(
        patch_size=1,
        in_channels=4,
        context_in_dim=8,
        hidden_size=16,
        mlp_ratio=2.0,
        num_heads=2,
        depth=4,
        axes_dim=[4, 4],
    )
    pipe = PRXPipeline(
        transformer=draw_zero_weights(transformer),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=None,
        tokenizer=None,
        vae=kl_vae(4, shift_factor=0.0, scaling_factor=1.0),
    )
    mask = torch.ones(1, 8, dtype=torch.bool)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 8, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 8, 8, seed=2),
        negative_prompt_attention_mask=mask,
        negative_prompt=None,
        guidance_scale=4.0,
        height=16,
        width=16,
        use_resolution_binning=False,
    )
    return finish(pipe), kwargs


def ernie_image():
    """ERNIE-Image: one single-stream list over the joined image and text (sequence first), batched CFG, 16 px
    (Flux.2's ×1 VAE behind a 2×2 patchify). Its zero-initialised parameters are drawn at random."""
    from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    transformer = ErnieImageTransformer2DModel(
        hidden_size=32,
        num_attention_heads=2,
        num_layers=4,
        ffn_hidden_size=32,
        in_channels=4,
        out_channels=4,
        patch_size=1,
        text_in_dim=16,
        rope_axes_dim=(4, 6, 6),
    )
    pipe = ErnieImagePipeline(
        transformer=draw_zero_weights(transformer),
        vae=flux2_vae(),
        text_encoder=None,
        tokenizer=None,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    kwargs = common_kwargs(
        prompt_embeds=[randn(8, 16, seed=1)],
        negative_prompt_embeds=[randn(8, 16, seed=2)],
        guidance_scale=4.0,
        height=16,
        width=16,
    )
    return finish(pipe), kwargs


def hunyuan_dit():
    """HunyuanDiT: one list of cross-attention blocks `(h, e) -> h` with U-Net-like long skips between them (the
    model's loop hands them on), batched CFG, DDPM steps, 16 px (a ×2 VAE)."""
    from diffusers import DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline

    torch.manual_seed(0)
    transformer = HunyuanDiT2DModel(
        sample_size=16,
        num_layers=4,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=3,
        in_channels=4,
        cross_attention_dim=32,
        cross_attention_dim_t5=32,
        pooled_projection_dim=16,
        hidden_size=24,
        activation_fn="gelu-approximate",
        text_len=8,
        text_len_t5=8,
    ).eval()
    pipe = HunyuanDiTPipeline(
        vae=small_kl_vae(4),
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        scheduler=DDPMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        text_encoder_2=None,
        tokenizer_2=None,
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 32, seed=1),
        prompt_attention_mask=mask,
        prompt_embeds_2=randn(1, 8, 32, seed=2),
        prompt_attention_mask_2=mask,
        negative_prompt_embeds=randn(1, 8, 32, seed=3),
        negative_prompt_attention_mask=mask,
        negative_prompt_embeds_2=randn(1, 8, 32, seed=4),
        negative_prompt_attention_mask_2=mask,
        guidance_scale=5.0,
        height=16,
        width=16,
        use_resolution_binning=False,
    )
    return finish(pipe), kwargs


def dit():
    """DiT (class-conditional): one list of `h -> h` blocks, batched CFG, DDIM steps, 32 px (a ×2 VAE)."""
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    torch.manual_seed(0)
    transformer = DiTTransformer2DModel(
        sample_size=16,
        num_layers=4,
        patch_size=4,
        attention_head_dim=8,
        num_attention_heads=2,
        in_channels=4,
        out_channels=8,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_zero",
        norm_elementwise_affine=False,
    ).eval()
    pipe = DiTPipeline(transformer=transformer, vae=small_kl_vae(4), scheduler=DDIMScheduler())
    kwargs = common_kwargs(class_labels=[1], guidance_scale=4.0, output_type="np")
    return finish(pipe), kwargs


def lumina_next():
    """Lumina-Next: one list of blocks taking the text as a constant argument (`(h, e) -> h`, text fourth), batched
    CFG, 16 px (a ×2 VAE; the pipeline assumes ×8, so 64 px ask for 8×8 latents)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LuminaNextDiT2DModel, LuminaPipeline

    torch.manual_seed(0)
    transformer = LuminaNextDiT2DModel(
        sample_size=4,
        patch_size=2,
        in_channels=4,
        hidden_size=8,
        num_layers=4,
        num_attention_heads=1,
        num_kv_heads=1,
        multiple_of=16,
        ffn_dim_multiplier=None,
        norm_eps=1e-5,
        learn_sigma=True,
        qk_norm=True,
        cross_attention_dim=8,
        scaling_factor=1.0,
    ).eval()
    pipe = LuminaPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=kl_vae(4),
        text_encoder=None,
        tokenizer=None,
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 8, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 8, 8, seed=2),
        negative_prompt_attention_mask=mask,
        guidance_scale=4.0,
        height=64,
        width=64,
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
        Case("Z-Image", zimage, separate_cfg=False, settings={**SETTINGS, "residual_diff_threshold": 0.8}),
        Case("HunyuanImage 2.1", hunyuan_image, separate_cfg=True, cache_dit_lists="separate"),
        Case("Ovis-Image", ovis_image, separate_cfg=True, cache_dit_lists="separate"),
        Case(
            "Bria 3.2",
            bria,
            separate_cfg=False,
            cache_dit_lists="separate",
            cache_dit_fails="its adapter declares Bria's blocks `(h, e) -> (h, e)`; they return `(e, h)`",
        ),
        Case("PRX", prx, separate_cfg=False),
        Case("ERNIE-Image", ernie_image, separate_cfg=False),
        Case("HunyuanDiT", hunyuan_dit, separate_cfg=False),
        Case("DiT", dit, separate_cfg=False),
        Case("Lumina-Next", lumina_next, separate_cfg=False),
    )
}
"""The cases of `FAMILIES` entries after Krea-2, keyed by family name."""
