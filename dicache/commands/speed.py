"""Loading and speed options shared by `dicache generate` and `dicache serve`: `--load-format`,
`--quantization fp8`, `--text-encoder-quantization fp8`, `--compile` and `--compile-artifact`.

Quantization happens while loading (each block as it is read) for a model in one process; a model split over
processes (torchrun) is loaded unquantised, split, then quantised. Compilation comes after quantization.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..models.options import SpeedOptions, TextEncoderOptions
from ..models.store_layout import artifact_store, weight_snapshot_store
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
    """Quantize what loading did not quantize (if asked: the transformer, then the text encoder), then compile (if
    asked) `pipe` in place."""
    spec = speed_spec(args)
    if spec is not None and getattr(getattr(pipe, "transformer", None), "quantization", None) is None:
        pipe.quantize(spec)
    method = text_encoder_quantization(args)
    if method is not None and getattr(pipe, "text_encoder_quantization", None) is None:
        pipe.quantize_text_encoder(method)
    if getattr(args, "compile", False):
        pipe.compile()


def compile_artifact_store(args: argparse.Namespace) -> Any:
    """The compile-artifact store of `args` (`--compile-artifact`, else `DICACHE_COMPILE_ARTIFACT`) when `--compile`
    is given, else None."""
    if not getattr(args, "compile", False):
        return None
    return artifact_store(getattr(args, "compile_artifact", None))


def weight_store(args: argparse.Namespace, at_load: bool = True) -> Any:
    """Where loading keeps and finds the quantised transformer and text encoder (`weight_snapshot`): the
    compile-artifact store, with `--compile`, `--artifact-weights` (on by default) and a quantization applied while
    loading (`at_load`), else None."""
    return weight_snapshot_store(
        getattr(args, "compile_artifact", None),
        compile=getattr(args, "compile", False),
        artifact_weights=getattr(args, "artifact_weights", True),
        quantized=speed_spec(args) is not None or text_encoder_quantization(args) is not None,
        at_load=at_load,
    )
