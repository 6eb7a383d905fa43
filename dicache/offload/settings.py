"""The offload options, declared once (`OffloadSettings`, SGLang's names and meanings plus `gpu_memory_budget`), and
the largest request a plan must hold (`OffloadLimits`).

One `OffloadSettings` travels from the command line (`dicache.commands.memory`, options derived from these
declarations) or a Python caller (`Krea2Pipeline.from_pretrained(..., dit_layerwise_offload=True)`) to the planner
(`plan.plan_memory`) and the installer (`pipeline.install_offload`); nothing repacks it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import field_validator

from ..errors import ConfigError
from ..settings.options import FlagOptions, option

PREFETCH_FLAG = "--dit-offload-prefetch-size"
BUDGET_FLAG = "--gpu-memory-budget"


def prefetch_blocks(value: float, num_blocks: int) -> int:
    """Blocks copied ahead of the running one, SGLang's `--dit-offload-prefetch-size` meaning.

    value < 1: a fraction of the layers, `1 + round(value · (num_blocks − 1))` (0 = one block ahead);
    value >= 1: that many layers (a whole number). Always at least 1 and at most `num_blocks`.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"{PREFETCH_FLAG}={value!r} is invalid: must be a number >= 0 (below 1: a fraction of the layers; "
            "1 or more: a whole number of layers)"
        )
    if value >= 1 and value != int(value):
        raise ConfigError(
            f"{PREFETCH_FLAG}={value!r} is invalid: 1 or more counts layers and must be a whole number "
            f"(below 1 it is a fraction of the {num_blocks} layers)"
        )
    count = 1 + round(value * (num_blocks - 1)) if value < 1 else int(value)
    return max(1, min(count, num_blocks))


class OffloadSettings(FlagOptions):
    """The memory options; all off by default (the pipeline loads resident on the device).

    Each field is declared with its command-line option (`dicache generate` / `dicache serve`); a bad value is a
    `ConfigError` naming the option. `dit_mode` and `offloads(role)` say what the settings ask of each component.
    """

    group: ClassVar[tuple[str, str]] = (
        "memory (small GPUs)",
        "fit Krea-2 in a 24 or 32 GB card; the plan (what stays, what streams) is printed at start-up and a budget "
        "that cannot hold the largest request is an error naming what was needed",
    )

    dit_layerwise_offload: bool = option(
        False,
        flag="--dit-layerwise-offload",
        switch=True,
        help="keep as many transformer blocks on the GPU as --gpu-memory-budget allows and stream the rest from "
        "pinned host memory, copying only the blocks each step runs (blocks the cache skips are never copied); CFG "
        "then runs cond and uncond in one batched call per step",
    )
    dit_offload_prefetch_size: float = option(
        0.0,
        flag=PREFETCH_FLAG,
        ge=0,
        metavar="N",
        help="streamed blocks copied ahead of the running one: below 1 a fraction of the layers (0 = one block), "
        "1 or more a number of layers",
    )
    dit_cpu_offload: bool = option(
        False,
        flag="--dit-cpu-offload",
        switch=True,
        help="keep the whole transformer in host memory and bring it to the GPU for each request's denoising "
        "(--dit-layerwise-offload wins when both are given)",
    )
    text_encoder_cpu_offload: bool = option(
        False,
        flag="--text-encoder-cpu-offload",
        switch=True,
        help="keep the text encoder in host memory, on the GPU only to encode",
    )
    vae_cpu_offload: bool = option(
        False, flag="--vae-cpu-offload", switch=True, help="keep the VAE in host memory, on the GPU only to decode"
    )
    pin_cpu_memory: bool = option(
        True,
        flag="--pin-cpu-memory",
        switch=True,
        help="page-lock the host copies for fast asynchronous transfers ('false' if pinning fails)",
    )
    gpu_memory_budget: float | None = option(
        None,
        flag=BUDGET_FLAG,
        gt=0,
        unit="GiB",
        metavar="GB",
        default_text="the free memory at start-up",
        help="GiB (2^30 bytes) the pipeline may use on the GPU",
    )

    @field_validator("dit_offload_prefetch_size", mode="before")
    @classmethod
    def _prefetch(cls, value: Any) -> Any:
        prefetch_blocks(value, 1 << 20)  # SGLang's meaning: a fraction below 1, a whole count from 1
        return value

    @field_validator("gpu_memory_budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> Any:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0
        ):
            raise ConfigError(f"{BUDGET_FLAG}={value!r} is invalid: must be a number of GiB > 0")
        return value

    @classmethod
    def given(cls, settings: OffloadSettings | None, options: Mapping[str, Any]) -> OffloadSettings:
        """`settings`, or the settings the keyword `options` name (`{"dit_layerwise_offload": True}`); both at once
        is a `ConfigError`."""
        if settings is None:
            return cls(**options)
        if options:
            raise ConfigError(f"pass the offload settings or options by name ({', '.join(options)}), not both")
        return settings

    @property
    def dit_mode(self) -> str:
        """'layerwise', 'cpu' (whole transformer brought in per request) or 'resident'."""
        if self.dit_layerwise_offload:
            return "layerwise"
        return "cpu" if self.dit_cpu_offload else "resident"

    def offloads(self, role: str) -> bool:
        """Whether the component playing `role` ("transformer", "text_encoder", "vae") is kept on the host whole."""
        return {
            "transformer": self.dit_mode == "cpu",
            "text_encoder": self.text_encoder_cpu_offload,
            "vae": self.vae_cpu_offload,
        }.get(role, False)

    @property
    def any(self) -> bool:
        """Whether any offload or a budget is asked for."""
        return (
            self.dit_layerwise_offload
            or self.dit_cpu_offload
            or self.text_encoder_cpu_offload
            or self.vae_cpu_offload
            or self.gpu_memory_budget is not None
        )


@dataclass(frozen=True)
class OffloadLimits:
    """The largest request a memory plan must hold; larger ones are refused before they start.

    max_height / max_width: pixels (None: the pipeline's default size). max_images: images per call. cfg: whether
    requests use CFG (None: unless the checkpoint is distilled). size_source: which options set these, for the
    out-of-memory message (e.g. " (--max-side, --max-n)").
    """

    max_height: int | None = None
    max_width: int | None = None
    max_images: int = 1
    cfg: bool | None = None
    size_source: str = ""

    def __post_init__(self) -> None:
        images = self.max_images
        if not isinstance(images, int) or isinstance(images, bool) or images < 1:
            raise ConfigError(f"max_images={images!r} is invalid: must be an integer >= 1")
