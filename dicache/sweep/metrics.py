"""Fidelity metrics: plain functions on tensors, one value per sample (no averaging, no hidden state).

Images are `(B, 3, H, W)` (or `(3, H, W)`) floats in [0, 1]; latents are any shape with the batch first.
- PSNR = 10 · log10(1 / MSE) dB, MSE over all pixels and channels of one image, capped at `PSNR_CAP_DB` when the
  images are identical (JSON has no infinity).
- SSIM: pytorch-msssim's `ssim` (11 px Gaussian window, σ = 1.5, data range 1); MS-SSIM (`ms_ssim`, 5 scales) only
  when both sides are at least `MS_SSIM_MIN_SIZE` px, else None.
- relative L2 = ‖a − b‖₂ / ‖b‖₂ per sample, `b` being the reference.
"""

from __future__ import annotations

import math

import torch

PSNR_CAP_DB = 100.0
MS_SSIM_MIN_SIZE = 161


def _batched(images: torch.Tensor) -> torch.Tensor:
    if images.ndim == 3:
        images = images.unsqueeze(0)
    if images.ndim != 4:
        raise ValueError(f"images must be (B, C, H, W) or (C, H, W), got shape {tuple(images.shape)}")
    return images.detach().to(torch.float64)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs reference {tuple(b.shape)}")


def psnr(images: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """PSNR in dB of each image against its reference (both in [0, 1]); identical images give `PSNR_CAP_DB`."""
    a, b = _batched(images), _batched(reference)
    _same_shape(a, b)
    mse = (a - b).pow(2).flatten(1).mean(1)
    return [
        PSNR_CAP_DB if m <= 10 ** (-PSNR_CAP_DB / 10) else min(PSNR_CAP_DB, -10 * math.log10(m)) for m in mse.tolist()
    ]


def ssim(images: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """SSIM (pytorch-msssim) of each image against its reference, data range 1; images need >= 11 px a side."""
    from pytorch_msssim import ssim as _ssim

    a, b = _batched(images), _batched(reference)
    _same_shape(a, b)
    return _ssim(a.float(), b.float(), data_range=1.0, size_average=False).tolist()


def ms_ssim(images: torch.Tensor, reference: torch.Tensor) -> list[float] | None:
    """MS-SSIM (pytorch-msssim, 5 scales) per image, or None below `MS_SSIM_MIN_SIZE` px on either side."""
    from pytorch_msssim import ms_ssim as _ms_ssim

    a, b = _batched(images), _batched(reference)
    _same_shape(a, b)
    if min(a.shape[-2:]) < MS_SSIM_MIN_SIZE:
        return None
    return _ms_ssim(a.float(), b.float(), data_range=1.0, size_average=False).tolist()


def relative_l2(latents: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """‖a − b‖ / ‖b‖ per sample (dim 0 is the batch), computed in float64."""
    _same_shape(latents, reference)
    a = latents.detach().to(torch.float64).reshape(latents.shape[0], -1)
    b = reference.detach().to(torch.float64).reshape(reference.shape[0], -1)
    return ((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)).tolist()
