"""QwenImageVAEDecoder against diffusers' AutoencoderKLQwenImage (tiny random configs, fp32)."""

from __future__ import annotations

import pytest
import torch

from dicache.models.krea2.tiny import tiny_vae_config
from dicache.models.krea2.vae import QwenImageVAEConfig, QwenImageVAEDecoder
from dicache.models.loading import CheckpointError

diffusers = pytest.importorskip("diffusers")

# Same channel multipliers as Qwen-Image (x8) at a tiny width, and a x4 variant like the embedded checkpoint's.
CONFIGS = {
    "x8": tiny_vae_config(
        base_dim=4, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
    ),
    "x4": tiny_vae_config(base_dim=4, z_dim=4),
}


def make_reference(name: str, seed: int = 0) -> diffusers.AutoencoderKLQwenImage:
    """A reference VAE with every weight randomised (norm gains and biases included) and random latent stats."""
    gen = torch.Generator().manual_seed(seed)
    config = dict(CONFIGS[name])
    config["latents_mean"] = torch.randn(4, generator=gen).tolist()
    config["latents_std"] = (torch.rand(4, generator=gen) + 0.5).tolist()
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLQwenImage(**config).eval()
    with torch.no_grad():
        for key, param in vae.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if key.endswith("gamma"):
                param.copy_(1.0 + 0.2 * noise)
            elif key.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.mul_(1.0 + 0.1 * noise)
    return vae


def reference_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """What Krea2Pipeline does after `_unpack_latents`: de-normalise, decode, take frame 0."""
    z = latents[:, :, None].to(vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
    with torch.no_grad():
        return vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]


def ours_from(vae) -> QwenImageVAEDecoder:
    model = QwenImageVAEDecoder(QwenImageVAEConfig.from_dict(dict(vae.config))).eval()
    model.load_diffusers_state_dict(dict(vae.state_dict()))
    return model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_matches_reference(name):
    vae = make_reference(name)
    ours = ours_from(vae)
    latents = torch.randn(2, 4, 6, 5, generator=torch.Generator().manual_seed(1))

    expected = reference_decode(vae, latents)
    with torch.no_grad():
        got = ours.decode(latents)

    assert ours.scale_factor == vae.spatial_compression_ratio == (8 if name == "x8" else 4)
    assert ours.z_dim == 4
    assert got.shape == expected.shape == (2, 3, 6 * ours.scale_factor, 5 * ours.scale_factor)
    assert expected.abs().max() < 1.0  # not saturated: the comparison covers the whole network, not the clamp
    assert expected.std() > 0.05
    assert relative_error(got, expected) <= 1e-5
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_output_clamped_like_reference():
    vae = make_reference("x4", seed=3)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(50.0)
    ours = ours_from(vae)
    latents = torch.randn(1, 4, 5, 7, generator=torch.Generator().manual_seed(2))
    expected = reference_decode(vae, latents)
    with torch.no_grad():
        got = ours.decode(latents)
    assert got.min() == -1.0 and got.max() == 1.0
    assert 0.05 < (got.abs() == 1.0).float().mean() < 0.95
    assert relative_error(got, expected) <= 1e-5


def test_bf16_close_to_fp32_reference():
    vae = make_reference("x8", seed=4)
    ours = ours_from(vae).to(torch.bfloat16)
    latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = ours.decode(latents)
    assert got.dtype == torch.bfloat16
    assert relative_error(got.float(), reference_decode(vae, latents)) < 3e-2


def test_from_pretrained_loads_diffusers_folder(tmp_path):
    vae = make_reference("x8", seed=5)
    vae.save_pretrained(tmp_path / "vae")
    ours = QwenImageVAEDecoder.from_pretrained(tmp_path)  # pipeline layout: the default subfolder "vae"
    same = QwenImageVAEDecoder.from_pretrained(tmp_path / "vae", subfolder=None)

    from safetensors import safe_open

    with safe_open(str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        saved = list(f.keys())
    assert any(k.startswith("encoder.") for k in saved) and any(k.startswith("quant_conv.") for k in saved)
    assert not any(k.startswith(("encoder.", "quant_conv.")) for k in ours.state_dict())
    assert ours.dtype == torch.float32 and not ours.training

    latents = torch.randn(1, 4, 5, 6, generator=torch.Generator().manual_seed(6))
    expected = reference_decode(vae, latents)
    with torch.no_grad():
        assert relative_error(ours.decode(latents), expected) <= 1e-5
        assert torch.equal(same.decode(latents), ours.decode(latents))


def test_own_state_dict_round_trips():
    ours = ours_from(make_reference("x4", seed=6))
    copy = QwenImageVAEDecoder(ours.config)
    copy.load_diffusers_state_dict(ours.state_dict())
    latents = torch.randn(1, 4, 3, 3)
    with torch.no_grad():
        assert torch.equal(copy.decode(latents), ours.decode(latents))


def test_unknown_key_is_an_error():
    vae = make_reference("x4")
    state = dict(vae.state_dict())
    state["decoder.up_blocks.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"unknown key.*decoder\.up_blocks\.0\.extra\.weight"):
        QwenImageVAEDecoder(QwenImageVAEConfig.from_dict(dict(vae.config))).load_diffusers_state_dict(state)


def test_time_conv_only_ignored_where_the_block_is_temporal():
    vae = make_reference("x4")  # decoder block 0 up-samples in time, block 1 does not
    state = dict(vae.state_dict())
    assert "decoder.up_blocks.0.upsamplers.0.time_conv.weight" in state
    state["decoder.up_blocks.1.upsamplers.0.time_conv.weight"] = state[
        "decoder.up_blocks.0.upsamplers.0.time_conv.weight"
    ]
    with pytest.raises(CheckpointError, match=r"up_blocks\.1\.upsamplers\.0\.time_conv\.weight"):
        ours_from(vae).load_diffusers_state_dict(state)


def test_missing_key_is_an_error():
    vae = make_reference("x4")
    state = {k: v for k, v in vae.state_dict().items() if k != "decoder.conv_out.bias"}
    with pytest.raises(CheckpointError, match=r"missing key.*decoder\.conv_out\.bias"):
        ours_from(vae).load_diffusers_state_dict(state)


def test_config_validation():
    with pytest.raises(ValueError, match="unknown Qwen-Image VAE config key"):
        QwenImageVAEConfig.from_dict({"base_dim": 8, "is_residual": True})
    with pytest.raises(ValueError, match="temperal_downsample"):
        QwenImageVAEConfig(dim_mult=(1, 2, 2), temperal_downsample=(False, True, True))
    assert QwenImageVAEConfig.from_dict({"_class_name": "AutoencoderKLQwenImage"}).scale_factor == 8


def test_decode_rejects_wrong_channels():
    ours = QwenImageVAEDecoder(**CONFIGS["x4"], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    with pytest.raises(ValueError, match=r"\(B, 4, h, w\)"):
        ours.decode(torch.zeros(1, 16, 4, 4))
