"""Qwen-Image VAE decoder for text-to-image: the decoding half of diffusers' `AutoencoderKLQwenImage`, one frame.

The reference is a causal video VAE. Decoding a single frame (T = 1) makes every temporal operation trivial, so this
module is plain 2-D and numerically equal to the reference's frame-0 output:

- A causal 3-D conv zero-pads `k_t - 1` frames *before* the input. With one input frame, the only non-zero frame
  under the kernel is the last temporal tap, so the conv equals a 2-D conv with `weight[:, :, -1]` (same bias, same
  spatial padding). Kernel-1 convs (`post_quant_conv`, shortcuts) keep their only slice.
- A temporal up-sampling block (`upsample3d`) skips its `time_conv` on the first chunk of frames (its feature cache
  is empty), so for T = 1 it is exactly the spatial `upsample2d` block; its `time_conv` weights are unused.
- The mid-block attention already works frame by frame (single head over the h*w positions).

Weights load from diffusers checkpoints (`post_quant_conv.*`, `decoder.*`): temporal kernels are sliced and RMS-norm
gains flattened on load; encoder keys (`encoder.*`, `quant_conv.*`) are ignored; any other unknown key is an error.
Tiled decoding is not implemented (a 1024^2 image decodes in one pass).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

from dicache.models.loading import CheckpointError, load_component, load_into_module

# Qwen-Image per-channel latent statistics (diffusers' defaults for `AutoencoderKLQwenImage`).
QWEN_IMAGE_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
QWEN_IMAGE_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip

# Checkpoint keys that belong to the encoding half of the autoencoder and are dropped on load.
ENCODER_PREFIXES = ("encoder.", "quant_conv.")


@dataclasses.dataclass(frozen=True)
class QwenImageVAEConfig:
    """The `config.json` of a diffusers `AutoencoderKLQwenImage` (keys starting with `_` are metadata, ignored).

    `temperal_downsample[i]` (sic, diffusers' spelling) marks encoder stage i as also halving time; the decoder mirrors
    it, which does not matter for one frame. There are `len(dim_mult) - 1` spatial x2 stages.
    """

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    input_channels: int = 3
    latents_mean: tuple[float, ...] = QWEN_IMAGE_LATENTS_MEAN
    latents_std: tuple[float, ...] = QWEN_IMAGE_LATENTS_STD

    def __post_init__(self):
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if len(self.dim_mult) < 2:
            raise ValueError(f"dim_mult={list(self.dim_mult)}: needs at least 2 entries")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"temperal_downsample has {len(self.temperal_downsample)} entries; dim_mult={list(self.dim_mult)} "
                f"needs {len(self.dim_mult) - 1}"
            )
        for name in ("latents_mean", "latents_std"):
            if len(getattr(self, name)) != self.z_dim:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries; z_dim={self.z_dim} needs as many")

    @classmethod
    def from_dict(cls, config: dict) -> QwenImageVAEConfig:
        """Build from a config dict; metadata keys (`_class_name`, ...) are ignored, other unknown keys raise."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in config if k not in known and not k.startswith("_"))
        if unknown:
            raise ValueError(f"unknown Qwen-Image VAE config key(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in config.items() if k in known})

    @property
    def scale_factor(self) -> int:
        """Spatial up-sampling factor from latent to pixel grid (8 for Qwen-Image)."""
        return 2 ** (len(self.dim_mult) - 1)


NORM_CHUNK_ELEMENTS = 1 << 25
"""Most elements a half-precision `RMSNorm` widens to float32 at once: a 1024² decode normalises 96 x 1024 x 1024
values per call, whose float32 copies would otherwise be the decode's memory peak (1.41 GB of live tensors, 1.01 GB
in chunks; counted on fake tensors)."""


class RMSNorm(nn.Module):
    """Channel RMS norm of `(B, C, H, W)`: `x / ||x||_2 over C * sqrt(C) * gamma` (fp32 statistics for half types).

    Each pixel's statistics involve its own channels only, so half-precision inputs are normalised in row chunks of
    at most `NORM_CHUNK_ELEMENTS` (same values, smaller float32 temporaries)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.gamma.view(-1, 1, 1)
        if x.dtype not in (torch.float16, torch.bfloat16):
            return F.normalize(x, dim=1) * self.scale * gamma
        out = torch.empty_like(x)
        rows = max(1, NORM_CHUNK_ELEMENTS // max(1, x.shape[0] * x.shape[1] * x.shape[3]))
        for start in range(0, x.shape[2], rows):
            part = x[:, :, start : start + rows]
            out[:, :, start : start + rows] = F.normalize(part.float(), dim=1).to(x.dtype) * self.scale * gamma
        return out


class ResidualBlock(nn.Module):
    """norm -> SiLU -> conv3x3 -> norm -> SiLU -> conv3x3, plus a (1x1-projected if needed) shortcut."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.norm1 = RMSNorm(in_dim)
        self.conv1 = nn.Conv2d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim)
        self.conv2 = nn.Conv2d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))  # dropout sits here in training; this module is inference-only
        return h + self.conv_shortcut(x)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H*W positions of each image, with a residual connection."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(b, 1, 3 * c, h * w).transpose(2, 3)  # (B, 1, HW, 3C)
        q, k, v = qkv.contiguous().chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, 1, HW, C)
        out = out.squeeze(1).transpose(1, 2).reshape(b, c, h, w)
        return self.proj(out) + x


class MidBlock(nn.Module):
    """ResidualBlock -> AttentionBlock -> ResidualBlock at the lowest resolution."""

    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        for attention, resnet in zip(self.attentions, self.resnets[1:]):
            x = resnet(attention(x))
        return x


class Upsample2x(nn.Module):
    """Nearest x2 spatial up-sampling (`nearest-exact`, which for an integer factor is plain pixel repetition)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="nearest-exact")


class Upsampler(nn.Module):
    """x2 nearest up-sampling then a 3x3 conv that halves the channels. `resample.1` matches diffusers' key names."""

    def __init__(self, dim: int):
        super().__init__()
        self.resample = nn.Sequential(Upsample2x(), nn.Conv2d(dim, dim // 2, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resample(x)


class UpBlock(nn.Module):
    """`num_res_blocks + 1` residual blocks, then optionally an `Upsampler`."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, upsample: bool):
        super().__init__()
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = nn.ModuleList([ResidualBlock(i, o) for i, o in zip(dims[:-1], dims[1:])])
        self.upsamplers = nn.ModuleList([Upsampler(out_dim)]) if upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class Decoder(nn.Module):
    """Latent `(B, z_dim, h, w)` (already through `post_quant_conv`) -> unclamped image `(B, C, h*f, w*f)`."""

    def __init__(self, config: QwenImageVAEConfig):
        super().__init__()
        mult = config.dim_mult
        dims = [config.base_dim * m for m in (mult[-1], *reversed(mult))]
        self.conv_in = nn.Conv2d(config.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList()
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            in_dim = in_dim if i == 0 else in_dim // 2  # every up-sampler before this block halved the channels
            upsample = i < len(mult) - 1
            self.up_blocks.append(UpBlock(in_dim, out_dim, config.num_res_blocks, upsample))
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], config.input_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class QwenImageVAEDecoder(nn.Module):
    """Decode normalised Qwen-Image latents `(B, z_dim, h, w)` to images `(B, 3, h*f, w*f)` in [-1, 1].

    `f = scale_factor` (8 for Qwen-Image / Krea-2). Computation runs in the module's parameter dtype.
    """

    def __init__(self, config: QwenImageVAEConfig | None = None, **config_kwargs):
        super().__init__()
        if config is None:
            config = QwenImageVAEConfig(**config_kwargs)
        elif config_kwargs:
            raise TypeError("pass either a QwenImageVAEConfig or keyword config values, not both")
        self.config = config
        self.post_quant_conv = nn.Conv2d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder(config)

    @property
    def z_dim(self) -> int:
        return self.config.z_dim

    @property
    def scale_factor(self) -> int:
        return self.config.scale_factor

    @property
    def dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """`latents * latents_std + latents_mean` per channel, in the latents' dtype.

        Written as `latents / (1 / std) + mean`, the Krea-2 pipeline's exact arithmetic, so results match bitwise.
        """
        shape = (1, self.z_dim, 1, 1)
        # queued copies: a pageable source is staged before `to` returns, and the host never waits for the GPU
        mean = torch.tensor(self.config.latents_mean).view(shape).to(latents.device, latents.dtype, non_blocking=True)
        std = torch.tensor(self.config.latents_std).view(shape).to(latents.device, latents.dtype, non_blocking=True)
        inv_std = 1.0 / std
        return latents / inv_std + mean

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents `(B, z_dim, h, w)` (as the transformer produces them, unpacked) -> `(B, 3, H, W)`.

        Latents are cast to the module dtype, de-normalised, decoded and clamped to [-1, 1]; a non-finite value (NaN,
        ±inf) comes out as NaN, never clamped into range, so that a numerical failure stays visible to the caller.
        """
        if latents.ndim != 4 or latents.shape[1] != self.z_dim:
            raise ValueError(f"latents must have shape (B, {self.z_dim}, h, w); got {tuple(latents.shape)}")
        z = self.denormalize(latents.to(self.dtype))
        image = self.decoder(self.post_quant_conv(z))
        return image.clamp(-1.0, 1.0).masked_fill_(~torch.isfinite(image), float("nan"))

    forward = decode

    # ---- loading -------------------------------------------------------------------------------------------------

    def unused_checkpoint_prefixes(self) -> tuple[str, ...]:
        """Checkpoint key prefixes this decoder drops: the encoder half and the temporal up-sampling convs."""
        temporal = reversed(self.config.temperal_downsample)  # decoder stage i mirrors encoder stage n-1-i
        time_convs = tuple(f"decoder.up_blocks.{i}.upsamplers.0.time_conv." for i, t in enumerate(temporal) if t)
        return ENCODER_PREFIXES + time_convs

    def load_diffusers_state_dict(self, state_dict: dict[str, torch.Tensor], *, source: str = "state dict") -> None:
        """Load an `AutoencoderKLQwenImage` (or this module's own) state dict strictly; see the module docstring."""
        load_into_module(
            self,
            convert_diffusers_state_dict(state_dict),
            source=source,
            ignore_prefixes=self.unused_checkpoint_prefixes(),
        )

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | os.PathLike,
        subfolder: str | None = "vae",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        load_format: str = "auto",
        **hub_kwargs,
    ) -> QwenImageVAEDecoder:
        """Load from a diffusers `AutoencoderKLQwenImage` folder (local or Hub; `hub_kwargs`: `cache_dir`,
        `revision`, `local_files_only`). dtype defaults to bf16 on CUDA, fp32 otherwise. Returns an eval-mode module.
        """
        return load_component(
            path_or_repo_id,
            subfolder,
            lambda config, directory: cls(_parse_config(config, directory)),
            dtype=dtype,
            device=device,
            load_format=load_format,
            load_weights=lambda model, state_dict, source: model.load_diffusers_state_dict(state_dict, source=source),
            **hub_kwargs,
        )


def _parse_config(config: dict, directory: os.PathLike) -> QwenImageVAEConfig:
    try:
        return QwenImageVAEConfig.from_dict(config)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"invalid config.json in {directory}: {err}") from err


def convert_diffusers_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map `AutoencoderKLQwenImage` tensors to this module's 2-D layout (keys are kept; unknown keys pass through).

    5-D causal conv kernels `(out, in, k_t, k, k)` keep their last temporal slice (see the module docstring); RMS-norm
    gains `(C, 1, 1[, 1])` become `(C,)`. Tensors already in the 2-D layout are returned unchanged.
    """
    converted = {}
    for key, tensor in state_dict.items():
        if key.endswith(".weight") and tensor.ndim == 5:
            tensor = tensor[:, :, -1].contiguous()
        elif key.endswith(".gamma") and tensor.ndim > 1:
            tensor = tensor.reshape(-1)
        converted[key] = tensor
    return converted
