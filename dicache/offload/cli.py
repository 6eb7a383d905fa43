"""Command-line options for small GPUs, shared by `dicache generate` and `dicache serve` (SGLang's names and meanings).

add_offload_arguments(parser)
pipe = Krea2Pipeline.from_pretrained(model, device=device, **offload_options(args, max_height=..., ...))
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from .plan import OffloadSettings

SWITCHES = ("dit_layerwise_offload", "dit_cpu_offload", "text_encoder_cpu_offload", "vae_cpu_offload")
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class _Switch(argparse.Action):
    """`--flag` (on), `--flag true|false` (SGLang's boolean options)."""

    def __init__(self, option_strings, dest, default=False, help=None):
        super().__init__(option_strings, dest, nargs="?", const=True, default=default, help=help)

    def __call__(self, parser, namespace, value, option_string=None):
        if isinstance(value, str):
            lowered = value.strip().lower()
            if lowered not in TRUE + FALSE:
                parser.error(f"{option_string}={value!r} is invalid: must be true or false (or no value: true)")
            value = lowered in TRUE
        setattr(namespace, self.dest, bool(value))


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the memory options to `parser` (all off by default: the pipeline loads resident on the device)."""
    group = parser.add_argument_group(
        "memory (small GPUs)",
        "fit Krea-2 in a 24 or 32 GB card; the plan (what stays, what streams) is printed at start-up and a budget "
        "that cannot hold the largest request is an error naming what was needed",
    )
    group.add_argument(
        "--dit-layerwise-offload",
        action=_Switch,
        help="keep as many transformer blocks on the GPU as --gpu-memory-budget allows and stream the rest from "
        "pinned host memory, copying only the blocks each step runs (blocks the cache skips are never copied); CFG "
        "then runs cond and uncond in one batched call per step",
    )
    group.add_argument(
        "--dit-offload-prefetch-size",
        type=float,
        default=0.0,
        metavar="N",
        help="streamed blocks copied ahead of the running one: below 1 a fraction of the layers (0 = one block), "
        "1 or more a number of layers (default: 0)",
    )
    group.add_argument(
        "--dit-cpu-offload",
        action=_Switch,
        help="keep the whole transformer in host memory and bring it to the GPU for each request's denoising "
        "(--dit-layerwise-offload wins when both are given)",
    )
    group.add_argument(
        "--text-encoder-cpu-offload",
        action=_Switch,
        help="keep the text encoder in host memory, on the GPU only to encode",
    )
    group.add_argument(
        "--vae-cpu-offload", action=_Switch, help="keep the VAE in host memory, on the GPU only to decode"
    )
    group.add_argument(
        "--pin-cpu-memory",
        action=_Switch,
        default=True,
        help="page-lock the host copies for fast asynchronous transfers (default: true; 'false' if pinning fails)",
    )
    group.add_argument(
        "--gpu-memory-budget",
        type=float,
        default=None,
        metavar="GB",
        help="GiB (2^30 bytes) the pipeline may use on the GPU (default: the free memory at start-up)",
    )


def settings_from_args(args: argparse.Namespace) -> OffloadSettings:
    """The validated settings the options ask for; a bad value is a `ConfigError` naming the option."""
    return OffloadSettings(
        dit_layerwise_offload=bool(getattr(args, "dit_layerwise_offload", False)),
        dit_offload_prefetch_size=getattr(args, "dit_offload_prefetch_size", 0.0),
        dit_cpu_offload=bool(getattr(args, "dit_cpu_offload", False)),
        text_encoder_cpu_offload=bool(getattr(args, "text_encoder_cpu_offload", False)),
        vae_cpu_offload=bool(getattr(args, "vae_cpu_offload", False)),
        pin_cpu_memory=bool(getattr(args, "pin_cpu_memory", True)),
        gpu_memory_budget=getattr(args, "gpu_memory_budget", None),
    )


def cfg_of(guidance: float | None, variant: str | None) -> bool | None:
    """Whether requests use CFG, from `--guidance` / `--variant` (None: unknown until the checkpoint says)."""
    if guidance is not None:
        return guidance > 1.0
    return None if variant is None else variant == "raw"


def describe(pipe: Any) -> str | None:
    """The memory plan of a pipeline loaded with offload, for the start-up log (None without offload)."""
    offload = getattr(pipe, "offload", None)
    return None if offload is None else offload.plan.describe()


def offload_options(
    args: argparse.Namespace,
    *,
    max_height: int | None = None,
    max_width: int | None = None,
    max_images: int = 1,
    cfg: bool | None = None,
    size_source: str = "",
    parallel: bool = False,
    cache_config: Any = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Keyword arguments for `Krea2Pipeline.from_pretrained` from the options: {} when none asks for offload.

    max_height / max_width / max_images / cfg: the largest request to plan for (None: the pipeline's defaults);
    size_source: which options set them, for the out-of-memory message. parallel: the model is split over processes
    (not supported together with offload). cache_config: the cache settings requests will use. workers: requests
    run at once (the plan holds one: more is an error).
    """
    settings = settings_from_args(args)
    if not settings.any:
        return {}
    if parallel:
        raise ConfigError(
            "the memory options (--dit-layerwise-offload, --dit-cpu-offload, --text-encoder-cpu-offload, "
            "--vae-cpu-offload, --gpu-memory-budget) cannot be combined with --tp-size / --ulysses-degree > 1"
        )
    if workers > 1:
        raise ConfigError(
            f"--workers {workers} is invalid with the memory options: an offloaded pipeline's memory plan holds one "
            "request at a time; use --workers 1"
        )
    limits = dict(
        max_height=max_height,
        max_width=max_width,
        max_images=max_images,
        cfg=cfg,
        size_source=size_source,
        cache_config=cache_config,
    )
    return {**settings.__dict__, "offload_limits": limits}
