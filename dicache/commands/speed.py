"""Loading and speed options shared by `dicache generate` and `dicache serve`: `--load-format`,
`--quantization fp8`, `--text-encoder-quantization fp8` and `--compile`.

Quantization and compilation apply to a loaded (and, under torchrun, already split) pipeline in this order:
quantize, then compile.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..models.options import SpeedOptions, TextEncoderOptions
from ..offload.settings import OffloadSettings
from ..quantization import QuantizationError, parse_quantization
from .fields import add_options, values_from_args


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--load-format`, `--quantization`, `--quantization-exclude`, `--compile` (`SpeedOptions`) and
    `--text-encoder-quantization` (`TextEncoderOptions`) to `parser`."""
    add_options(parser, SpeedOptions)
    add_options(parser, TextEncoderOptions)


def speed_spec(args: argparse.Namespace) -> Any:
    """The validated quantization of `args` (None: none), checked before any model is loaded (with the text
    encoder's: not together with the memory options, whose loading path quantizes the transformer only)."""
    if text_encoder_quantization(args) is not None and OffloadSettings(**values_from_args(args, OffloadSettings)).any:
        raise QuantizationError(
            f"{TextEncoderOptions.flag('text_encoder_quantization')} cannot be combined with the memory options"
        )
    return parse_quantization(getattr(args, "quantization", None), getattr(args, "quantization_exclude", None))


def text_encoder_quantization(args: argparse.Namespace) -> str | None:
    """`--text-encoder-quantization` as a method name, or None."""
    method = getattr(args, "text_encoder_quantization", None)
    return None if method in (None, "none") else method


def apply_speed_options(pipe: Any, args: argparse.Namespace) -> None:
    """Quantize (if asked: the transformer, then the text encoder), then compile (if asked) `pipe` in place."""
    spec = speed_spec(args)
    if spec is not None:
        pipe.quantize(spec)
    method = text_encoder_quantization(args)
    if method is not None:
        pipe.quantize_text_encoder(method)
    if getattr(args, "compile", False):
        pipe.compile()
