"""Krea-2 latent layout and image output: packing latents into tokens, RoPE positions, decoded pixels to outputs, and
the check that an output is finite.

Packed latents are `(B, N, C·p²)`: `N = rows·cols` tokens, each a `p × p` patch of the `C`-channel latent image.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from dicache.errors import NonFiniteOutputError

FINITE_PLACES = ("latents after denoising", "decoded image")
"""Where `finite_per_image(latents, images)` looks, in order: each image's latents, then its decoded pixels."""


def pack(latents: torch.Tensor, patch_size: int) -> torch.Tensor:
    """`(B, C, h, w)` -> `(B, (h/p)(w/p), C·p²)`."""
    b, c, h, w = latents.shape
    p = patch_size
    x = latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def unpack(tokens: torch.Tensor, rows: int, cols: int, patch_size: int) -> torch.Tensor:
    """`(B, rows·cols, C·p²)` -> `(B, C, rows·p, cols·p)`."""
    b, _, cp = tokens.shape
    p = patch_size
    x = tokens.view(b, rows, cols, cp // (p * p), p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, cp // (p * p), rows * p, cols * p)


def position_ids(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """`(rows·cols, 3)` RoPE coordinates `(0, h, w)` of the image tokens (text tokens sit at the origin)."""
    ids = torch.zeros(rows, cols, 3, device=device)
    ids[..., 1] = torch.arange(rows, device=device)[:, None]
    ids[..., 2] = torch.arange(cols, device=device)[None, :]
    return ids.reshape(rows * cols, 3)


def to_output(decoded: torch.Tensor, output_type: str) -> Any:
    """The VAE's `(B, 3, H, W)` output in [-1, 1] as `output_type`: "pt" a float tensor in [0, 1], "np" a
    `(B, H, W, 3)` float array in [0, 1], "pil" a list of 8-bit PIL images. A NaN stays NaN in "pt" and "np" (the
    VAE turns every non-finite value into NaN); check with `finite_per_image` before making "pil" images."""
    images = (decoded.float() / 2 + 0.5).clamp(0, 1)
    if output_type == "pt":
        return images
    array = images.permute(0, 2, 3, 1).cpu().numpy()
    if output_type == "np":
        return array
    return pil_images(array)


def pil_images(array: np.ndarray) -> list[Image.Image]:
    """`(B, H, W, 3)` floats in [0, 1] -> 8-bit PIL images (`round(x · 255)`, the pipeline's "pil" output)."""
    return [Image.fromarray((a * 255).round().astype(np.uint8)) for a in array]


def finite_per_image(*tensors: torch.Tensor) -> torch.Tensor:
    """`(len(tensors), B)` bool on the tensors' device: whether every value of batch item `b` of each tensor is
    finite (all tensors batch-first with the same `B`). One reduction per tensor, queued: no host sync."""
    return torch.stack([torch.isfinite(t).flatten(1).all(1) for t in tensors])


def check_finite(flags: torch.Tensor, places: tuple[str, ...] = FINITE_PLACES) -> None:
    """Raise `NonFiniteOutputError` naming every image with a False in `flags` (`finite_per_image`'s, read here: one
    host sync) and the first of `places` where it is; return if all are finite."""
    rows = flags.tolist()
    bad = {}
    for image in range(len(rows[0]) if rows else 0):
        place = next((places[row] for row in range(len(rows)) if not rows[row][image]), None)
        if place is not None:
            bad[image] = place
    if bad:
        raise NonFiniteOutputError(bad, len(rows[0]))
