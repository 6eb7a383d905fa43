"""Krea-2 sampling conventions: the variant presets (Turbo, Raw), variant resolution, the guidance formula.

Guidance follows the standard convention used by the serving docs: `v = uncond + s·(cond − uncond)`, `s = 1` means
no CFG (no uncond pass). Krea's reference form (and diffusers' `Krea2Pipeline`) writes `cond + g·(cond − uncond)`;
the two are the same with `g = s − 1` (Raw's s = 4.5 is g = 3.5), and `guided_velocity` computes the reference form
so its numbers match diffusers'. Presets: `turbo` = 8 steps, no CFG, shift pinned at mu = 1.15; `raw` = 50 steps,
s = 4.5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dicache.models.krea2.scheduler import TURBO_MU


@dataclass(frozen=True)
class Preset:
    num_inference_steps: int
    guidance_scale: float
    mu: float | None  # None: resolution-aware shift


PRESETS: dict[str, Preset] = {
    "turbo": Preset(num_inference_steps=8, guidance_scale=1.0, mu=TURBO_MU),
    "raw": Preset(num_inference_steps=50, guidance_scale=4.5, mu=None),
}
OUTPUT_TYPES = ("pil", "np", "pt", "latent")


def resolve_variant(pipe: Any, variant: str | None) -> str:
    """`variant` checked against `PRESETS`, or, when None, the checkpoint's own: turbo if distilled, else raw."""
    variant = variant or ("turbo" if getattr(pipe, "is_distilled", False) else "raw")
    if variant not in PRESETS:
        raise ValueError(f"variant={variant!r} is invalid: must be one of {', '.join(PRESETS)}")
    return variant


def schedule_mu(variant: str, is_distilled: bool) -> float | None:
    """The scheduler shift `mu` of a request: pinned for a distilled checkpoint, else the variant's preset value."""
    if is_distilled:
        return TURBO_MU
    return PRESETS[variant].mu if variant == "turbo" else None


def guided_velocity(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance with the standard scale s: v_cond + (s - 1) (v_cond - v_uncond)."""
    return cond + (guidance_scale - 1.0) * (cond - uncond)
