"""Loading and speed options shared by `dicache generate` and `dicache serve`: `--load-format`,
`--quantization fp8` and `--compile`.

Quantization and compilation apply to a loaded (and, under torchrun, already split) pipeline in this order:
quantize, then compile.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..models.options import SpeedOptions
from ..quantization import parse_quantization
from .fields import add_options


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--load-format`, `--quantization`, `--quantization-exclude` and `--compile` (`SpeedOptions`) to `parser`."""
    add_options(parser, SpeedOptions)


def speed_spec(args: argparse.Namespace) -> Any:
    """The validated quantization of `args` (None: none), checked before any model is loaded."""
    return parse_quantization(getattr(args, "quantization", None), getattr(args, "quantization_exclude", None))


def apply_speed_options(pipe: Any, args: argparse.Namespace) -> None:
    """Quantize (if asked), then compile (if asked) `pipe` in place."""
    spec = speed_spec(args)
    if spec is not None:
        pipe.quantize(spec)
    if getattr(args, "compile", False):
        pipe.compile()
