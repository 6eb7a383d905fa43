"""Shared parts of the tiny family pipelines (`tiny_families.py`, `tiny_families_more.py`): the `Case` record, seeded
random prompt embeddings, call arguments, a tiny KL VAE, and the measurement helpers (generation, PSNR, cache-dit's
run with the issue-24 settings)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

STEPS = 8

SETTINGS = {"residual_diff_threshold": 0.5, "max_warmup_steps": 1}
"""The issue-24 settings every family is checked with (defaults otherwise: Fn=1, Bn=0, MC=3)."""


@dataclass(frozen=True)
class Case:
    """A family's tiny pipeline: `build()` gives `(pipe, kwargs)`. `separate_cfg`: the pipeline makes one transformer
    call per CFG branch with these kwargs (cache-dit's `enable_separate_cfg`). `cache_dit_lists`: how cache-dit's
    registered adapter caches the block lists (`separate`: each on its own, as for HunyuanVideo or Chroma), i.e. the
    `lists=` layout whose images equal cache-dit's; `cache_dit_form`: the `form=` mapping of the lists cache-dit
    caches where it caches only some of them (AuraFlow: the single-stream list). `settings`: the cache settings of
    the checks (`SETTINGS` unless a family needs another threshold to cache at all with random weights).
    `cache_dit_fails`: why cache-dit 1.5.3 cannot run this family (the checks then compare with dicache's own
    recorded figure in that layout)."""

    family: str
    build: Callable[[], tuple[Any, dict]]
    separate_cfg: bool
    cache_dit_lists: str = "joined"
    cache_dit_form: Mapping[str, str] | None = None
    settings: Mapping[str, Any] = field(default_factory=lambda: dict(SETTINGS))
    cache_dit_fails: str = ""


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=seeded(seed))


def common_kwargs(**kw: Any) -> dict:
    return {"num_inference_steps": STEPS, "generator": seeded(0), "output_type": "pt", **kw}


def kl_vae(latent_channels: int, **kw: Any):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    config = dict(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    config.update(kw)
    return AutoencoderKL(**config).eval()


def small_kl_vae(latent_channels: int, **kw: Any):
    """A ×2 KL VAE (two levels of 4 channels)."""
    return kl_vae(
        latent_channels,
        block_out_channels=(4, 4),
        norm_num_groups=2,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        **kw,
    )


def flux2_vae():
    """Flux.2's VAE at ×1 (one level of 4 channels, one latent channel; its pipelines patchify 2×2 on top)."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    return AutoencoderKLFlux2(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


def draw_zero_weights(model: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    """Draw the parameters a model initialises to zero (adaLN-zero gates, zero output projections) at random, so its
    blocks change what they are given (seeded)."""
    generator = seeded(7)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.numel() > 1 and not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model


def finish(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


def images(output: Any) -> torch.Tensor:
    """The decoded images (or video frames) of a pipeline output, as a float tensor in [0, 1]."""
    value = next(getattr(output, name) for name in ("images", "frames", "image", "audios") if hasattr(output, name))
    return torch.as_tensor(value).float()


def generate(pipe: Any, kwargs: dict) -> torch.Tensor:
    """One generation with `kwargs` and a fresh generator of the same seed (and the global generator seeded too, for
    pipelines that draw from it, such as JoyImage-Edit's image encoding)."""
    torch.manual_seed(0)
    with torch.no_grad():
        return images(pipe(**{**kwargs, "generator": seeded(0)}))


def psnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    """PSNR in dB of images in [0, 1] (inf when equal)."""
    mse = torch.mean((reference.float() - other.float()) ** 2).item()
    return float("inf") if mse == 0 else 10.0 * math.log10(1.0 / mse)


def cache_dit_psnr(case: Case, pipe: Any, kwargs: dict, plain: torch.Tensor) -> tuple[float, int]:
    """PSNR against `plain` of `pipe` cached by cache-dit 1.5.3 with the case's settings (its registered adapter),
    and the calls it cached. Leaves the pipeline as it found it."""
    import cache_dit

    config = cache_dit.DBCacheConfig(
        num_inference_steps=STEPS,
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        max_warmup_steps=case.settings["max_warmup_steps"],
        residual_diff_threshold=case.settings["residual_diff_threshold"],
        max_continuous_cached_steps=3,
        enable_separate_cfg=case.separate_cfg,
    )
    cache_dit.enable_cache(pipe, cache_config=config)
    try:
        out = generate(pipe, kwargs)
        summaries = [s for s in cache_dit.summary(pipe, logging=False) if s.cache_options]
        first = summaries[0]
        cached = len(first.cached_steps or []) + len(first.cfg_cached_steps or [])
    finally:
        cache_dit.disable_cache(pipe)
    return psnr(plain, out), cached


def cache_dit_layout(case: Case) -> dict:
    """The `dicache.enable` arguments that cache the lists as cache-dit's adapter does ({}: the default layout)."""
    if case.cache_dit_form is not None:
        return {"form": dict(case.cache_dit_form)}
    return {"lists": "separate"} if case.cache_dit_lists == "separate" else {}
