"""The memory options of `dicache generate` and `dicache serve` (small GPUs), derived from their declaration
(`dicache.offload.settings.OffloadSettings`), and the one `OffloadSettings` the parsed options ask for."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from ..offload.settings import OffloadSettings
from .fields import add_options, flagged, values_from_args


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the memory options to `parser`, in their own help group. Values are checked when the settings are built
    (`offload_settings`: a `ConfigError` naming the option, before any model loads)."""
    add_options(parser, OffloadSettings, checked=False)


def offload_settings(args: argparse.Namespace, *, parallel: bool = False, workers: int = 1) -> OffloadSettings:
    """The validated settings the options ask for; a bad value is a `ConfigError` naming the option.

    parallel: the model is split over processes (not supported together with offload). workers: requests run at
    once (an offload plan holds one: more is an error).
    """
    settings = OffloadSettings(**values_from_args(args, OffloadSettings))
    if settings.any and parallel:
        raise ConfigError(
            f"the memory options ({', '.join(memory_flags())}) cannot be combined with --tp-size / --ulysses-degree > 1"
        )
    if settings.any and workers > 1:
        raise ConfigError(
            f"--workers {workers} is invalid with the memory options: an offloaded pipeline's memory plan holds one "
            "request at a time; use --workers 1"
        )
    return settings


def memory_flags() -> list[str]:
    """The options that ask for offload (all but the prefetch size and pinning, which only shape it)."""
    shaping = ("dit_offload_prefetch_size", "pin_cpu_memory")
    return [OffloadSettings.flag(name) for name in flagged(OffloadSettings) if name not in shaping]


def cfg_of(guidance: float | None, variant: str | None) -> bool | None:
    """Whether requests use CFG, from `--guidance` / `--variant` (None: unknown until the checkpoint says)."""
    if guidance is not None:
        return guidance > 1.0
    return None if variant is None else variant == "raw"


def describe(pipe: Any) -> str | None:
    """The memory plan of a pipeline loaded with offload, for the start-up log (None without offload)."""
    offload = getattr(pipe, "offload", None)
    return None if offload is None else offload.plan.describe()
