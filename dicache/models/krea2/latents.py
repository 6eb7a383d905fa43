"""Krea-2 latent layout and image output: packing latents into tokens, RoPE positions, decoded pixels to outputs.

Packed latents are `(B, N, C·p²)`: `N = rows·cols` tokens, each a `p × p` patch of the `C`-channel latent image.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image


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
    `(B, H, W, 3)` float array in [0, 1], "pil" a list of 8-bit PIL images."""
    images = (decoded.float() / 2 + 0.5).clamp(0, 1)
    if output_type == "pt":
        return images
    array = images.permute(0, 2, 3, 1).cpu().numpy()
    if output_type == "np":
        return array

    return [Image.fromarray((a * 255).round().astype(np.uint8)) for a in array]
