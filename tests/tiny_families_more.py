"""Tiny diffusers pipelines of the families registered after the first seventeen (`tiny_families.py` has those and
merges `MORE_CASES` into its `CASES`); same conventions: diffusers' test sizes with a few more blocks, random prompt
embeddings instead of text encoders, 8 steps, decoded output in `[0, 1]`."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from PIL import Image
from tiny_parts import (
    SETTINGS,
    Case,
    common_kwargs,
    draw_zero_weights,
    finish,
    flux2_vae,
    kl_vae,
    randn,
    seeded,
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


@contextmanager
def small_edit_area(pixels: int = 32 * 32):
    """Qwen-Image-Edit sizes its input image (and so its output) to about 1024² pixels; within this context it sizes
    them to `pixels` instead, so the tiny case takes seconds."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as module

    original = module.calculate_dimensions
    module.calculate_dimensions = lambda _area, ratio: original(pixels, ratio)
    try:
        yield
    finally:
        module.calculate_dimensions = original


def qwen_image_edit():
    """QwenImageEditPipeline over the Qwen-Image case: the input image's latents join the image stream; true CFG.
    Call it within `small_edit_area()`."""
    from diffusers import QwenImageEditPipeline
    from tiny_families import qwen_image

    base, kwargs = qwen_image()
    pipe = QwenImageEditPipeline(
        scheduler=base.scheduler,
        vae=base.vae,
        text_encoder=None,
        tokenizer=None,
        processor=None,
        transformer=base.transformer,
    )
    pixels = (torch.rand(32, 32, 3, generator=seeded(5)) * 255).to(torch.uint8).numpy()
    kwargs.update(image=Image.fromarray(pixels), height=None, width=None)
    return finish(pipe), kwargs


def hunyuan_dit_pag():
    """HunyuanDiTPAGPipeline over the HunyuanDiT case: perturbed-attention guidance on block 1, the uncond, cond and
    perturbed copies batched in one call."""
    from diffusers import HunyuanDiTPAGPipeline

    base, kwargs = hunyuan_dit()
    pipe = HunyuanDiTPAGPipeline(
        vae=base.vae,
        text_encoder=None,
        tokenizer=None,
        transformer=base.transformer,
        scheduler=base.scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        text_encoder_2=None,
        tokenizer_2=None,
        pag_applied_layers="blocks.1",
    )
    kwargs.update(pag_scale=3.0)
    return finish(pipe), kwargs


# ---------------------------------------------------------------------- video families on Wan's architecture
WAN_CONFIG = dict(
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
"""Wan's tiny transformer config (`tiny_families.wan`), shared by the families built on its blocks."""


def wan_parts():
    """Wan's tiny VAE (16 latent channels, ×8 in space, ×4 in time) and its UniPC flow scheduler."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    return vae, UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def wan_call(**kw):
    """The call arguments of the Wan-architecture cases: CFG, 9 frames of 16 px, random T5-sized embeddings."""
    return common_kwargs(
        **{
            "prompt_embeds": randn(1, 16, 32, seed=1),
            "negative_prompt_embeds": randn(1, 16, 32, seed=2),
            "guidance_scale": 5.0,
            "height": 16,
            "width": 16,
            "num_frames": 9,
            **kw,
        }
    )


def wan_vace():
    """Wan VACE: the VACE blocks turn the control video into hints, which the model adds after the blocks
    `vace_layers` names (by index: the walk keeps them there); CFG as two calls per step, 9 frames of 16 px."""
    from diffusers import WanVACEPipeline, WanVACETransformer3DModel

    torch.manual_seed(0)
    transformer = WanVACETransformer3DModel(**WAN_CONFIG, vace_layers=[0, 2], vace_in_channels=96)
    vae, scheduler = wan_parts()
    pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=transformer)
    video = [Image.fromarray(frame) for frame in random_frames(9, 16, seed=6)]
    return finish(pipe), wan_call(video=video)


def skyreels_v2():
    """SkyReels-V2 (text to video): Wan's blocks, CFG as two calls per step, 9 frames of 16 px."""
    from diffusers import SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel

    torch.manual_seed(0)
    transformer = SkyReelsV2Transformer3DModel(**WAN_CONFIG)
    vae, scheduler = wan_parts()
    pipe = SkyReelsV2Pipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae, scheduler=scheduler)
    return finish(pipe), wan_call()


def chronoedit():
    """ChronoEdit (image editing as a short video): Wan's blocks with image cross-attention (a tiny CLIP vision
    encoder), CFG as two calls per step, 5 frames of 16 px from one input image."""
    from diffusers import ChronoEditPipeline, ChronoEditTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    config = {**WAN_CONFIG, "in_channels": 36, "image_dim": 4, "added_kv_proj_dim": 24}
    transformer = ChronoEditTransformer3DModel(**config)
    torch.manual_seed(0)
    encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=4,
            projection_dim=4,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=8,
            image_size=32,
            patch_size=16,
        )
    ).eval()
    vae, scheduler = wan_parts()
    pipe = ChronoEditPipeline(
        tokenizer=None,
        text_encoder=None,
        image_encoder=encoder,
        image_processor=CLIPImageProcessor(crop_size=32, size=32),
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
    )
    kwargs = wan_call(image=Image.fromarray(random_frames(1, 16, seed=6)[0]))
    kwargs["num_frames"] = 5
    return finish(pipe), kwargs


def cosmos_guardrail():
    """A stand-in for the Cosmos guardrail (which is a large model): passes every prompt and video."""
    from diffusers import ConfigMixin, ModelMixin

    class PassThroughGuardrail(ModelMixin, ConfigMixin):
        def __init__(self):
            super().__init__()
            self.register_buffer("anchor", torch.zeros(1))  # the pipeline reads its device from it

        def check_text_safety(self, prompt: str) -> bool:
            return True

        def check_video_safety(self, video):
            return video

    return PassThroughGuardrail()


def cosmos():
    """Cosmos Predict 2 (text to image): blocks `(h, e) -> h` with the text as cross-attention, CFG as two calls per
    step, 32 px with Wan's VAE. Its zero-initialised parameters are drawn at random. The case compares latents
    (`output_type="latent"`): the tiny VAE decodes them to a nearly flat image, which the guardrail's 8-bit round trip
    then makes equal for any cache."""
    from diffusers import Cosmos2TextToImagePipeline, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    transformer = CosmosTransformer3DModel(
        in_channels=16,
        out_channels=16,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=4,
        mlp_ratio=2,
        text_embed_dim=32,
        adaln_lora_dim=4,
        max_size=(4, 32, 32),
        patch_size=(1, 2, 2),
        rope_scale=(2.0, 1.0, 1.0),
        concat_padding_mask=False,  # True needs torchvision
        extra_pos_embed_type="learnable",
    )
    vae, _ = wan_parts()
    pipe = Cosmos2TextToImagePipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=draw_zero_weights(transformer),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True),
        safety_checker=cosmos_guardrail(),
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 16, 32, seed=1),
        negative_prompt_embeds=randn(1, 16, 32, seed=2),
        guidance_scale=3.0,
        height=32,
        width=32,
        output_type="latent",
    )
    return finish(pipe), kwargs


def kandinsky5():
    """Kandinsky 5 (text to image): text blocks, then the visual blocks `(h, e) -> h` the cache covers; CFG as two
    calls per step, 64 px with a ×2 VAE (the pipeline accepts listed resolutions only: 64² is added). Its
    zero-initialised parameters are drawn at random."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2IPipeline, Kandinsky5Transformer3DModel

    torch.manual_seed(0)
    transformer = Kandinsky5Transformer3DModel(
        in_visual_dim=16,
        in_text_dim=32,
        in_text_dim2=16,
        time_dim=16,
        out_visual_dim=16,
        patch_size=(1, 2, 2),
        model_dim=16,
        ff_dim=32,
        num_text_blocks=1,
        num_visual_blocks=4,
        axes_dims=(1, 1, 2),
        visual_cond=False,
        attention_type="regular",
    )
    pipe = Kandinsky5T2IPipeline(
        transformer=draw_zero_weights(transformer),
        vae=small_kl_vae(16),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )
    pipe.resolutions = [(64, 64)]
    cu_seqlens = torch.tensor([0, 8], dtype=torch.int32)
    kwargs = common_kwargs(
        prompt_embeds_qwen=randn(1, 8, 32, seed=1),
        prompt_embeds_clip=randn(1, 16, seed=2),
        prompt_cu_seqlens=cu_seqlens,
        negative_prompt_embeds_qwen=randn(1, 8, 32, seed=3),
        negative_prompt_embeds_clip=randn(1, 16, seed=4),
        negative_prompt_cu_seqlens=cu_seqlens,
        guidance_scale=4.0,
        height=64,
        width=64,
    )
    return finish(pipe), kwargs


def hunyuan_video15():
    """HunyuanVideo 1.5: one list of `(h, e) -> (h, e)` blocks, CFG as two calls per step through its guider, 9
    frames of 16 px."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance

    torch.manual_seed(0)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=4,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,
        text_embed_2_dim=32,
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),
        target_size=16,
        task_type="t2v",
    ).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        downsample_match_channel=False,
        upsample_match_channel=False,
    ).eval()
    pipe = HunyuanVideo15Pipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=4.0),
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 16, seed=1),
        prompt_embeds_mask=mask,
        negative_prompt_embeds=randn(1, 8, 16, seed=2),
        negative_prompt_embeds_mask=mask,
        prompt_embeds_2=randn(1, 8, 32, seed=3),
        prompt_embeds_mask_2=mask,
        negative_prompt_embeds_2=randn(1, 8, 32, seed=4),
        negative_prompt_embeds_mask_2=mask,
        height=16,
        width=16,
        num_frames=9,
    )
    return finish(pipe), kwargs


def allegro():
    """Allegro: one list of cross-attention blocks `(h, e) -> h`, batched CFG, DDIM steps, 8 frames of 16 px. Its
    zero-initialised parameters are drawn at random; the case compares latents (its VAE decodes in tiles only, and
    16 px decode to a constant)."""
    from diffusers import AllegroPipeline, AllegroTransformer3DModel, AutoencoderKLAllegro, DDIMScheduler

    torch.manual_seed(0)
    transformer = AllegroTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        cross_attention_dim=24,
        sample_width=8,
        sample_height=8,
        sample_frames=8,
        caption_channels=24,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLAllegro(
        in_channels=3,
        out_channels=3,
        down_block_types=("AllegroDownBlock3D",) * 4,
        up_block_types=("AllegroUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    ).eval()
    vae.enable_tiling()
    pipe = AllegroPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        transformer=draw_zero_weights(transformer),
        scheduler=DDIMScheduler(),
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 24, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 8, 24, seed=2),
        negative_prompt_attention_mask=mask,
        negative_prompt=None,
        guidance_scale=6.0,
        height=16,
        width=16,
        num_frames=8,
        output_type="latent",
    )
    return finish(pipe), kwargs


def easyanimate():
    """EasyAnimate: one list of `(h, e) -> (h, e)` blocks, batched CFG, 5 frames of 16 px."""
    from diffusers import (
        AutoencoderKLMagvit,
        EasyAnimatePipeline,
        EasyAnimateTransformer3DModel,
        FlowMatchEulerDiscreteScheduler,
    )

    torch.manual_seed(0)
    transformer = EasyAnimateTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,  # its rotary embedding splits a head in quarters and eighths
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=16,
        num_layers=4,
        sample_width=16,
        sample_height=16,
        patch_size=2,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLMagvit(
        in_channels=3,
        out_channels=3,
        down_block_types=("SpatialDownBlock3D",) + ("SpatialTemporalDownBlock3D",) * 3,
        up_block_types=("SpatialUpBlock3D",) + ("SpatialTemporalUpBlock3D",) * 3,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        spatial_group_norm=False,
    ).eval()
    pipe = EasyAnimatePipeline(
        vae=vae, text_encoder=None, tokenizer=None, transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler()
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 16, seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 8, 16, seed=2),
        negative_prompt_attention_mask=mask,
        guidance_scale=6.0,
        height=16,
        width=16,
        num_frames=5,
    )
    return finish(pipe), kwargs


def stable_audio():
    """Stable Audio Open: one list of cross-attention blocks `h -> h` (the text comes as a keyword), batched CFG,
    EDM DPM-Solver steps, a few stereo samples from the Oobleck VAE. Its zero-initialised parameters are drawn at
    random."""
    from diffusers import (
        AutoencoderOobleck,
        EDMDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioPipeline,
        StableAudioProjectionModel,
    )

    torch.manual_seed(0)
    transformer = StableAudioDiTModel(
        sample_size=4,
        in_channels=3,
        num_layers=4,
        attention_head_dim=4,
        num_key_value_attention_heads=2,
        out_channels=3,
        cross_attention_dim=4,
        time_proj_dim=8,
        global_states_input_dim=8,
        cross_attention_input_dim=4,
    )
    scheduler = EDMDPMSolverMultistepScheduler(  # its own cosine DPM-Solver needs torchsde
        solver_order=2, prediction_type="v_prediction", sigma_data=1.0, sigma_schedule="exponential"
    )
    torch.manual_seed(0)
    vae = AutoencoderOobleck(
        encoder_hidden_size=6,
        downsampling_ratios=[1, 2],
        decoder_channels=3,
        decoder_input_channels=3,
        audio_channels=2,
        channel_multiples=[2, 4],
        sampling_rate=4,
    ).eval()
    torch.manual_seed(0)
    projection = StableAudioProjectionModel(text_encoder_dim=32, conditioning_dim=4, min_value=0, max_value=32)
    pipe = StableAudioPipeline(
        vae=vae,
        text_encoder=None,
        projection_model=projection,
        tokenizer=None,
        transformer=draw_zero_weights(transformer),
        scheduler=scheduler,
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 32, seed=1),
        attention_mask=mask,
        negative_prompt_embeds=randn(1, 8, 32, seed=2),
        negative_attention_mask=mask,
        guidance_scale=6.0,
    )
    return finish(pipe), kwargs


def anyflow():
    """AnyFlow (flow-map text to video on Wan's blocks): blocks `(h, e) -> h`, batched CFG, flow-map Euler steps, 9
    frames of 16 px."""
    from diffusers import AnyFlowPipeline, AnyFlowTransformer3DModel, FlowMapEulerDiscreteScheduler

    torch.manual_seed(0)
    config = {key: value for key, value in WAN_CONFIG.items() if key != "qk_norm"}
    transformer = AnyFlowTransformer3DModel(**config, gate_value=0.25, deltatime_type="r")
    vae, _ = wan_parts()
    scheduler = FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    pipe = AnyFlowPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae, scheduler=scheduler)
    return finish(pipe), wan_call(guidance_scale=6.0)


def helios():
    """Helios (chunked text to video with history on Wan's blocks): blocks `(h, e) -> h`, CFG as two calls per step,
    frames of 16 px."""
    from diffusers import HeliosPipeline, HeliosScheduler, HeliosTransformer3DModel

    torch.manual_seed(0)
    config = {key: value for key, value in WAN_CONFIG.items() if key not in ("rope_max_seq_len",)}
    transformer = HeliosTransformer3DModel(
        **config,
        rope_dim=(4, 4, 4),
        has_multi_term_memory_patch=True,
        guidance_cross_attn=True,
        zero_history_timestep=True,
        is_amplify_history=False,
    )
    vae, _ = wan_parts()
    scheduler = HeliosScheduler(stage_range=[0, 1], stages=1, use_dynamic_shifting=True)
    pipe = HeliosPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=transformer)
    return finish(pipe), wan_call()


def joyimage_edit():
    """JoyImage-Edit: one list of `(h, e) -> (h, e)` blocks over the input image and the target, CFG as two calls per
    step, 32 px with Wan's VAE (latents compared: it decodes them flat). The pipeline sizes images to its 1024²
    buckets; this pipe's image processor keeps 32² instead, so the tiny case takes seconds."""
    from diffusers import FlowMatchEulerDiscreteScheduler, JoyImageEditPipeline, JoyImageEditTransformer3DModel

    torch.manual_seed(0)
    transformer = JoyImageEditTransformer3DModel(
        patch_size=[1, 2, 2],
        in_channels=16,
        hidden_size=32,
        num_attention_heads=2,
        text_dim=16,
        num_layers=4,
        rope_dim_list=[4, 6, 6],
        theta=256,
    )
    vae, _ = wan_parts()
    pipe = JoyImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        processor=None,
    )
    pipe.vae_image_processor.get_default_height_width = lambda image, height, width: (32, 32)
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        image=Image.fromarray(random_frames(1, 32, seed=6)[0]),
        prompt_embeds=randn(1, 8, 16, seed=1),
        prompt_embeds_mask=mask,
        negative_prompt_embeds=randn(1, 8, 16, seed=2),
        negative_prompt_embeds_mask=mask,
        guidance_scale=4.0,
        height=32,
        width=32,
        output_type="latent",
    )
    return finish(pipe), kwargs


def ltx2():
    """LTX-2 (video with audio): one list of blocks that update the video and the audio stream, `(h, e) -> (h, e)`
    with the audio as `e` (its text is a constant argument); batched CFG, 5 frames of 32 px. Latents compared (the
    video latents; the audio VAE and vocoder are skipped)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    text_dim, text_layers = 32, 2  # the connectors keep the width: 4 heads of 8
    torch.manual_seed(0)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=4,
        qk_norm="rms_norm_across_heads",
        caption_channels=text_dim,
        rope_double_precision=False,
        rope_type="split",
    )
    torch.manual_seed(0)
    connectors = LTX2TextConnectors(
        caption_channels=text_dim,
        text_proj_in_factor=text_layers + 1,
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_theta=10000.0,
        rope_double_precision=False,
        causal_temporal_positioning=False,
        rope_type="split",
    )
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    torch.manual_seed(0)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    )
    torch.manual_seed(0)
    vocoder = LTX2Vocoder(
        in_channels=16,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    )
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=None,
        tokenizer=None,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, text_dim * (text_layers + 1), seed=1),
        prompt_attention_mask=mask,
        negative_prompt_embeds=randn(1, 8, text_dim * (text_layers + 1), seed=2),
        negative_prompt_attention_mask=mask,
        guidance_scale=3.0,
        audio_guidance_scale=3.0,
        stg_scale=0.0,  # plain CFG: no spatio-temporal or modality guidance calls
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        guidance_rescale=0.0,
        audio_guidance_rescale=0.0,
        spatio_temporal_guidance_blocks=None,
        use_cross_timestep=False,
        height=32,
        width=32,
        num_frames=5,
        frame_rate=25.0,
        output_type="latent",
    )
    return finish(pipe), kwargs


def word_tokenizer(vocab_size: int = 64):
    """A word-level tokenizer built in memory (no hub access): the words `w3` … `w63` and `<unk>` for any other."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "<pad>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>", unk_token="<unk>")


def longcat_image():
    """LongCat-Image: Flux-like double- then single-stream blocks (both `(h, e) -> (e, h)`), CFG as two calls per
    step, 16 px (a ×1 VAE with the pipeline's fixed 16 latent channels). Its `prompt_embeds` path fails in diffusers
    0.42.1, so it encodes prompts with a word-level tokenizer and a tiny Qwen3 text model built in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LongCatImagePipeline, LongCatImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    transformer = LongCatImageTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    torch.manual_seed(0)
    text_encoder = Qwen3Model(
        Qwen3Config(
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=64,
            max_position_embeddings=1024,
        )
    ).eval()
    pipe = LongCatImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=kl_vae(16),
        text_encoder=text_encoder,
        tokenizer=word_tokenizer(),
        text_processor=None,
        transformer=transformer,
    )
    pipe.tokenizer_max_length = 16  # 512 by default
    kwargs = common_kwargs(
        prompt="w5 w9 w12 w30",
        negative_prompt="w7 w8",
        guidance_scale=4.5,
        height=16,
        width=16,
        enable_prompt_rewrite=False,
    )
    return finish(pipe), kwargs


def bria_fibo():
    """Bria-FIBO: double-stream blocks `(h, e) -> (e, h)`, then single blocks `h -> h` on the joined stream, each
    block given a fresh text layer by the model; batched CFG, 32 px with Wan 2.2's patchified VAE (latents compared).
    Prompts go through a word-level tokenizer and a tiny Qwen3 text model built in memory (its pipeline always
    tokenizes)."""
    from diffusers import (
        AutoencoderKLWan,
        BriaFiboPipeline,
        BriaFiboTransformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    transformer = BriaFiboTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=64,
        text_encoder_dim=32,
        pooled_projection_dim=None,
        axes_dims_rope=[0, 4, 4],
    )
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        num_res_blocks=1,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        temperal_downsample=[False, True, True],
        z_dim=16,
    ).eval()
    torch.manual_seed(0)
    text_encoder = Qwen3Model(
        Qwen3Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=64,
            max_position_embeddings=256,
        )
    ).eval()
    pipe = BriaFiboPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=word_tokenizer(),
    )
    kwargs = common_kwargs(
        prompt="w5 w9 w12 w30",
        negative_prompt="w7 w8",
        guidance_scale=5.0,
        height=32,
        width=32,
        output_type="latent",
    )
    return finish(pipe), kwargs


def glm_image():
    """GLM-Image (text to image): one list of `(h, e) -> (h, e)` blocks conditioned on the autoregressive prior's
    image tokens, CFG as two calls per step, 32 px (a ×8 VAE). The prior's tokens are given at random, so neither
    the autoregressive model nor its processor is needed."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel

    torch.manual_seed(0)
    transformer = GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        attention_head_dim=8,
        num_attention_heads=2,
        text_embed_dim=32,
        time_embed_dim=16,
        condition_dim=8,
        prior_vq_quantizer_codebook_size=128,
    )
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(4, 8, 16, 16),
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=128,
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()
    pipe = GlmImagePipeline(
        tokenizer=None,
        processor=None,
        text_encoder=None,
        vision_language_encoder=None,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, 32, seed=1),
        negative_prompt_embeds=randn(1, 8, 32, seed=2),
        prior_token_ids=torch.randint(0, 128, (1, 4), generator=seeded(3)),
        guidance_scale=1.5,
        height=32,
        width=32,
    )
    return finish(pipe), kwargs


def amused():
    """aMUSEd (masked image tokens, a U-ViT): one list of `(h, e) -> h` transformer layers between its convolutional
    stages, batched CFG, 8 px from a VQ decoder. Its scheduler keeps no step index and the U-ViT takes no timestep:
    steps are counted at the scheduler's `step`."""
    from diffusers import AmusedPipeline, AmusedScheduler, UVit2DModel, VQModel

    torch.manual_seed(0)
    transformer = UVit2DModel(
        hidden_size=8,
        use_bias=False,
        hidden_dropout=0.0,
        cond_embed_dim=8,
        micro_cond_encode_dim=2,
        micro_cond_embed_dim=10,
        encoder_hidden_size=8,
        vocab_size=32,
        codebook_size=8,
        in_channels=8,
        block_out_channels=8,
        num_res_blocks=1,
        downsample=True,
        upsample=True,
        block_num_heads=1,
        num_hidden_layers=4,
        num_attention_heads=1,
        attention_dropout=0.0,
        intermediate_size=8,
        layer_norm_eps=1e-06,
        ln_elementwise_affine=True,
    ).eval()
    torch.manual_seed(0)
    vqvae = VQModel(
        act_fn="silu",
        block_out_channels=[8],
        down_block_types=["DownEncoderBlock2D"],
        in_channels=3,
        latent_channels=8,
        layers_per_block=1,
        norm_num_groups=8,
        num_vq_embeddings=8,
        out_channels=3,
        sample_size=8,
        up_block_types=["UpDecoderBlock2D"],
        mid_block_add_attention=False,
        lookup_from_codebook=True,
    ).eval()
    pipe = AmusedPipeline(
        vqvae=vqvae,
        tokenizer=None,
        text_encoder=None,
        transformer=transformer,
        scheduler=AmusedScheduler(mask_token_id=31),
    )
    kwargs = common_kwargs(
        prompt_embeds=randn(1, 8, seed=1),
        encoder_hidden_states=randn(1, 8, 8, seed=2),
        negative_prompt_embeds=randn(1, 8, seed=3),
        negative_encoder_hidden_states=randn(1, 8, 8, seed=4),
        guidance_scale=10.0,
        height=8,
        width=8,
    )
    return finish(pipe), kwargs


def random_frames(count: int, size: int, seed: int):
    """`count` random RGB frames (uint8 arrays) of `size` px."""
    return list((torch.rand(count, size, size, 3, generator=seeded(seed)) * 255).to(torch.uint8).numpy())


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
        Case("Wan VACE", wan_vace, separate_cfg=True),
        Case("SkyReels-V2", skyreels_v2, separate_cfg=True),
        Case("ChronoEdit", chronoedit, separate_cfg=True),
        Case("Cosmos", cosmos, separate_cfg=True),
        Case("Kandinsky 5", kandinsky5, separate_cfg=True),
        Case("HunyuanVideo 1.5", hunyuan_video15, separate_cfg=True),
        Case("Allegro", allegro, separate_cfg=False),
        Case("AnyFlow", anyflow, separate_cfg=False),
        Case("JoyImage-Edit", joyimage_edit, separate_cfg=True),
        Case("LongCat-Image", longcat_image, separate_cfg=True, cache_dit_lists="separate"),
        Case("Bria-FIBO", bria_fibo, separate_cfg=False, cache_dit_lists="separate"),
        Case("GLM-Image", glm_image, separate_cfg=True),
        Case("aMUSEd", amused, separate_cfg=False),
        Case(
            "LTX-2",
            ltx2,
            separate_cfg=False,
            cache_dit_fails="its patched forward takes no `sigma` argument, which diffusers 0.42.1's LTX-2 passes",
        ),
        Case("Helios", helios, separate_cfg=True),
        Case("EasyAnimate", easyanimate, separate_cfg=False),
        Case(
            "Stable Audio",
            stable_audio,
            separate_cfg=False,
            settings={**SETTINGS, "residual_diff_threshold": 0.8},  # random weights: nothing cached at 0.5
        ),
    )
}
"""The cases of `FAMILIES` entries after Krea-2, keyed by family name."""
