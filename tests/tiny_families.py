"""Tiny diffusers pipelines of the first seventeen registered families, built from configs (no hub access), for the
family tests and `benchmarks/bench_families.py`; `CASES` also holds the later families' (`tiny_families_more.py`).

Sizes follow diffusers' own pipeline tests (`get_dummy_components`), with a few more blocks so a cache has a middle to
skip. Text encoders and tokenizers are left out: each case passes random prompt embeddings (and pooled embeddings /
masks where the pipeline needs them). `CASES[name].build()` returns `(pipe, call_kwargs)`; the kwargs ask for 8
steps, a fixed generator and decoded output in `[0, 1]` (`output_type="pt"`, or "np" where "pt" is not offered).
"""

from __future__ import annotations

from typing import Any

import torch
from tiny_families_more import MORE_CASES
from tiny_parts import (  # noqa: F401 (re-exported for the tests and the benchmark)
    SETTINGS,
    STEPS,
    Case,
    cache_dit_layout,
    cache_dit_psnr,
    common_kwargs,
    finish,
    flux2_vae,
    generate,
    kl_vae,
    psnr,
    randn,
    seeded,
)


# ---------------------------------------------------------------------- image families
def flux(text_len: int = 16, size: int = 16):
    """Flux.1 with true CFG (two calls per step). 16 px with a ×1 VAE: 64 image tokens; `text_len=64` makes the two
    streams equally long."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=kl_vae(1),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, text_len, 32, seed=1),
        pooled_prompt_embeds=randn(1, 32, seed=2),
        negative_prompt_embeds=randn(1, text_len, 32, seed=3),
        negative_pooled_prompt_embeds=randn(1, 32, seed=4),
        true_cfg_scale=2.0,
        height=size,
        width=size,
    )
    return finish(pipe), kwargs


def sd3(**call: Any):
    """SD3 / SD3.5: batched CFG (one call per step); `call` adds pipeline arguments (e.g. skip-layer guidance)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=4,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=kl_vae(4),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
        transformer=transformer,
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 12, 32, seed=1),
        pooled_prompt_embeds=randn(1, 64, seed=2),
        negative_prompt_embeds=randn(1, 12, 32, seed=3),
        negative_pooled_prompt_embeds=randn(1, 64, seed=4),
        guidance_scale=5.0,
        height=16,
        width=16,
        **call,
    )
    return finish(pipe), kwargs


def _qwen_vae():
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    return AutoencoderKLQwenImage(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()


def qwen_image():
    """Qwen-Image with true CFG (two calls per step), 32 px."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=4,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_qwen_vae(),
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
    )
    mask = torch.ones(1, 10, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 10, 16, seed=1),
        prompt_embeds_mask=mask,
        negative_prompt_embeds=randn(1, 10, 16, seed=2),
        negative_prompt_embeds_mask=mask,
        true_cfg_scale=3.0,
        height=32,
        width=32,
    )
    return finish(pipe), kwargs


def _wan_transformer(seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=4,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def wan(two_stage: bool = False):
    """Wan 2.1 (one transformer) or Wan 2.2 (`two_stage`: `transformer` above the boundary, `transformer_2` below),
    CFG as two calls per step, 9 frames of 16 px."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=scheduler,
        transformer=_wan_transformer(0),
        transformer_2=_wan_transformer(1) if two_stage else None,
        boundary_ratio=0.8 if two_stage else None,
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 16, 32, seed=1),
        negative_prompt_embeds=randn(1, 16, 32, seed=2),
        guidance_scale=5.0,
        height=16,
        width=16,
        num_frames=9,
    )
    return finish(pipe), kwargs


def wan22():
    return wan(two_stage=True)


def hunyuan_video():
    """HunyuanVideo: double- then single-stream blocks, true CFG (two calls per step), 5 frames of 16 px."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )

    torch.manual_seed(0)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=10,
        num_layers=2,
        num_single_layers=3,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    )
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        act_fn="silu",
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    ).eval()
    pipe = HunyuanVideoPipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
    )
    mask = torch.ones(1, 12)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 12, 16, seed=1),
        pooled_prompt_embeds=randn(1, 8, seed=2),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 12, 16, seed=3),
        negative_pooled_prompt_embeds=randn(1, 8, seed=4),
        negative_prompt_attention_mask=mask,
        true_cfg_scale=2.0,
        guidance_scale=4.5,
        height=16,
        width=16,
        num_frames=5,
    )
    return finish(pipe), kwargs


def cogvideox():
    """CogVideoX with a DDIM scheduler (no sigmas: steps come from its timesteps), batched CFG, 9 frames of 16 px."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXPipeline, CogVideoXTransformer3DModel, DDIMScheduler

    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=32,
        num_layers=4,
        sample_width=2,
        sample_height=2,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=16,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    ).eval()
    pipe = CogVideoXPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=DDIMScheduler()
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 16, 32, seed=1),
        negative_prompt_embeds=randn(1, 16, 32, seed=2),
        guidance_scale=6.0,
        height=16,
        width=16,
        num_frames=9,
    )
    return finish(pipe), kwargs


def cogview4():
    """CogView4, CFG as two calls per step, 16 px (a ×2 VAE)."""
    from diffusers import CogView4Pipeline, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    transformer = CogView4Transformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=4,
        attention_head_dim=4,
        num_attention_heads=4,
        out_channels=4,
        text_embed_dim=32,
        time_embed_dim=8,
        condition_dim=4,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
    )
    pipe = CogView4Pipeline(
        tokenizer=None,
        text_encoder=None,
        vae=kl_vae(
            4,
            block_out_channels=(4, 4),
            norm_num_groups=2,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
        ),
        transformer=transformer,
        scheduler=scheduler,
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 16, 32, seed=1),
        negative_prompt_embeds=randn(1, 16, 32, seed=2),
        guidance_scale=5.0,
        height=16,
        width=16,
    )
    return finish(pipe), kwargs


def lumina2():
    """Lumina 2, CFG as two calls per step; its forward's timestep rises over the steps (the scheduler's sigmas
    fall). The pipeline assumes a ×8 VAE: 64 px make 8×8 latents (16 tokens), decoded ×1 by the tiny VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    torch.manual_seed(0)
    transformer = Lumina2Transformer2DModel(
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
        scaling_factor=1.0,
        axes_dim_rope=[4, 2, 2],
        cap_feat_dim=8,
    )
    pipe = Lumina2Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=kl_vae(4),
        text_encoder=None,
        tokenizer=None,
    )
    mask = torch.ones(1, 10, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 10, 8, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 10, 8, seed=2),
        negative_prompt_attention_mask=mask,
        guidance_scale=4.0,
        height=64,
        width=64,
    )
    return finish(pipe), kwargs


def chroma():
    """Chroma: double-stream blocks, then the model joins text and image for the single-stream blocks; CFG as two
    calls per step, 16 px."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=[4, 4, 8],
        approximator_hidden_dim=32,
        approximator_layers=1,
        approximator_num_channels=16,
    )
    pipe = ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=kl_vae(1),
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
    )
    mask = torch.ones(1, 12, dtype=torch.bool)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 12, 32, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 12, 32, seed=2),
        negative_prompt_attention_mask=mask,
        guidance_scale=4.0,
        height=16,
        width=16,
    )
    return finish(pipe), kwargs


def hidream():
    """HiDream-I1: double-stream blocks with a fresh Llama layer per block, then single-stream blocks; batched CFG.
    The pipeline rescales every image to `default_sample_size` (set to 8 here: 16 px with a ×2 VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel

    torch.manual_seed(0)
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_channels=[32, 16],
        text_emb_dim=64,
        num_routed_experts=4,
        num_activated_experts=2,
        axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32),
        llama_layers=tuple(range(5)),  # one Llama layer per block
    ).eval()
    vae = kl_vae(
        4,
        block_out_channels=(4, 4),
        norm_num_groups=2,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
        text_encoder_4=None,
        tokenizer_4=None,
        transformer=transformer,
    )
    pipe.default_sample_size = 8
    kwargs = common_kwargs(
        prompt_embeds_t5=randn(1, 8, 32, seed=1),
        prompt_embeds_llama3=randn(5, 1, 8, 16, seed=2),
        pooled_prompt_embeds=randn(1, 64, seed=3),
        negative_prompt_embeds_t5=randn(1, 8, 32, seed=4),
        negative_prompt_embeds_llama3=randn(5, 1, 8, 16, seed=5),
        negative_pooled_prompt_embeds=randn(1, 64, seed=6),
        guidance_scale=5.0,
        height=16,
        width=16,
    )
    return finish(pipe), kwargs


def pixart(alpha: bool = False):
    """PixArt-Σ (`alpha`: PixArt-α) with a DDIM scheduler (no sigmas), batched CFG, 16 px (a ×2 VAE)."""
    from diffusers import DDIMScheduler, PixArtAlphaPipeline, PixArtSigmaPipeline, PixArtTransformer2DModel

    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(
        sample_size=8,
        num_layers=4,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=3,
        caption_channels=32,
        in_channels=4,
        cross_attention_dim=24,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    ).eval()
    vae = kl_vae(
        4,
        block_out_channels=(4, 4),
        norm_num_groups=2,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )
    cls = PixArtAlphaPipeline if alpha else PixArtSigmaPipeline
    pipe = cls(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=DDIMScheduler())
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 32, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 8, 32, seed=2),
        negative_prompt_attention_mask=mask,
        negative_prompt=None,
        guidance_scale=4.5,
        height=16,
        width=16,
        use_resolution_binning=False,
    )
    return finish(pipe), kwargs


def pixart_alpha():
    return pixart(alpha=True)


def sana():
    """Sana (linear attention, Gemma text), batched CFG, 32 px with a ×2 DC-AE."""
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel

    torch.manual_seed(0)
    transformer = SanaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        num_attention_heads=2,
        attention_head_dim=4,
        num_cross_attention_heads=2,
        cross_attention_head_dim=4,
        cross_attention_dim=8,
        caption_channels=8,
        sample_size=32,
    )
    torch.manual_seed(0)
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=[1, 1],
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    ).eval()
    pipe = SanaPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 8, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 8, 8, seed=2),
        negative_prompt_attention_mask=mask,
        negative_prompt=None,
        guidance_scale=4.5,
        height=32,
        width=32,
        use_resolution_binning=False,
        complex_human_instruction=None,
    )
    return finish(pipe), kwargs


def krea2():
    """diffusers' Krea-2 pipeline (the tiny 6-block transformer of `tiny_krea2`), CFG as two calls per step, 64 px."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline
    from tiny_krea2 import tiny_transformer

    from dicache.models.krea2.tiny import tiny_vae_config

    torch.manual_seed(0)
    transformer = tiny_transformer()
    vae = AutoencoderKLQwenImage(**tiny_vae_config(dim_mult=[1, 2, 2, 2], temperal_downsample=[False, True, True]))
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400
    )
    pipe = Krea2Pipeline(
        scheduler=scheduler, vae=vae.eval(), text_encoder=None, tokenizer=None, transformer=transformer
    )
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[:, :7] = True
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 12, 3, 32, seed=1),
        prompt_embeds_mask=mask,
        negative_prompt_embeds=randn(1, 12, 3, 32, seed=2),
        negative_prompt_embeds_mask=mask,
        guidance_scale=3.5,
        height=64,
        width=64,
    )
    return finish(pipe), kwargs


def flux2():
    """Flux.2 (guidance-distilled: one call per step): double-stream blocks, then the model joins text and image for
    the single-stream blocks; 16 px with a ×1 VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        timestep_guidance_channels=256,
        axes_dims_rope=[4, 4, 4, 4],
    )
    vae = flux2_vae()
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
    )
    kwargs = common_kwargs(prompt_embeds=randn(1, 8, 16, seed=1), guidance_scale=4.0, height=16, width=16)
    return finish(pipe), kwargs


def mochi():
    """Mochi 1: batched CFG, 7 frames of 16 px."""
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel

    torch.manual_seed(0)
    transformer = MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=4,
        pooled_projection_dim=16,
        in_channels=12,
        out_channels=None,
        qk_norm="rms_norm",
        text_embed_dim=32,
        time_embed_dim=4,
        activation_fn="swiglu",
        max_sequence_length=16,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLMochi(
        latent_channels=12,
        out_channels=3,
        encoder_block_out_channels=(32, 32, 32, 32),
        decoder_block_out_channels=(32, 32, 32, 32),
        layers_per_block=(1, 1, 1, 1, 1),
    ).eval()
    pipe = MochiPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )
    mask = torch.ones(1, 16, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 16, 32, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 16, 32, seed=2),
        negative_prompt_attention_mask=mask,
        guidance_scale=4.5,
        height=16,
        width=16,
        num_frames=7,
    )
    return finish(pipe), kwargs


def ltx():
    """LTX-Video: cross-attention blocks, batched CFG, 9 frames of 32 px."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        num_layers=4,
        caption_channels=32,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    ).eval()
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )
    mask = torch.ones(1, 16, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 16, 32, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 16, 32, seed=2),
        negative_prompt_attention_mask=mask,
        guidance_scale=3.0,
        height=32,
        width=32,
        num_frames=9,
    )
    return finish(pipe), kwargs


def cogview3plus():
    """CogView3-Plus with CogVideoX's DDIM scheduler, batched CFG, 16 px (a ×2 VAE)."""
    from diffusers import CogVideoXDDIMScheduler, CogView3PlusPipeline, CogView3PlusTransformer2DModel

    torch.manual_seed(0)
    transformer = CogView3PlusTransformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=4,
        attention_head_dim=4,
        num_attention_heads=2,
        out_channels=4,
        text_embed_dim=32,
        time_embed_dim=8,
        condition_dim=2,
        pos_embed_max_size=8,
        sample_size=8,
    )
    vae = kl_vae(
        4,
        block_out_channels=(4, 4),
        norm_num_groups=2,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )
    pipe = CogView3PlusPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=CogVideoXDDIMScheduler()
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 16, 32, seed=1),
        negative_prompt_embeds=randn(1, 16, 32, seed=2),
        guidance_scale=6.0,
        height=16,
        width=16,
    )
    return finish(pipe), kwargs


CASES: dict[str, Case] = {
    case.family: case
    for case in (
        Case("Flux.1", flux, separate_cfg=True),
        Case("Flux.2", flux2, separate_cfg=False, cache_dit_lists="separate"),
        Case("Qwen-Image", qwen_image, separate_cfg=True),
        Case("SD3 / SD3.5", sd3, separate_cfg=False),
        Case("Wan 2.1 / 2.2", wan22, separate_cfg=True),
        Case("HunyuanVideo", hunyuan_video, separate_cfg=True, cache_dit_lists="separate"),
        Case("CogVideoX", cogvideox, separate_cfg=False),
        Case("CogView4", cogview4, separate_cfg=True),
        Case("Lumina 2", lumina2, separate_cfg=True),
        Case("Chroma", chroma, separate_cfg=True, cache_dit_lists="separate"),
        Case("HiDream-I1", hidream, separate_cfg=False, cache_dit_lists="separate"),
        Case("PixArt-α / Σ", pixart, separate_cfg=False),
        Case("Sana", sana, separate_cfg=False),
        Case("Mochi 1", mochi, separate_cfg=False),
        Case("LTX-Video", ltx, separate_cfg=False),
        Case("CogView3-Plus", cogview3plus, separate_cfg=False),
        Case("Krea-2", krea2, separate_cfg=True),
    )
}
CASES.update(MORE_CASES)
"""One case per registered family (`dicache.adapters.FAMILIES`), keyed by family name."""


def flux_controlnet():
    """FluxControlNetPipeline over the Flux.1 case (no CFG): a tiny ControlNet whose zero-initialised output
    projections are drawn at random, so its per-block residuals change the image."""
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    pipe, kwargs = flux()
    torch.manual_seed(0)
    controlnet = FluxControlNetModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    with torch.no_grad():
        for projection in [*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks]:
            projection.weight.normal_(0.0, 0.05)
    control = FluxControlNetPipeline(
        scheduler=pipe.scheduler,
        vae=pipe.vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=pipe.transformer,
        controlnet=controlnet.eval(),
    )
    for key in ("negative_prompt_embeds", "negative_pooled_prompt_embeds", "true_cfg_scale"):
        kwargs.pop(key)
    kwargs.update(control_image=torch.rand(1, 3, 16, 16, generator=seeded(5)), controlnet_conditioning_scale=1.0)
    return finish(control), kwargs
