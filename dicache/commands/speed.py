"""Loading and speed options shared by `dicache generate` and `dicache serve`: `--load-format`,
`--quantization fp8` and `--compile`.

Quantization and compilation apply to a loaded (and, under torchrun, already split) pipeline in this order:
quantize, then compile.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..models.loading import LOAD_FORMATS
from ..quantization import LAYER_GROUPS, NO_EXCLUSIONS, QUANTIZATION_METHODS, QuantizationError, parse_quantization


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--load-format`, `--quantization`, `--quantization-exclude` and `--compile` to `parser`."""
    group = parser.add_argument_group("loading and speed")
    group.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="auto: read the checkpoint's weights; dummy: random weights from its config files alone, for speed and "
        "memory measurements (SGLang's flag) (default: auto)",
    )
    group.add_argument(
        "--quantization",
        choices=("none", *QUANTIZATION_METHODS),
        default="none",
        help="fp8: the transformer blocks' linears run FP8 e4m3 (per-row activation, per-channel weight scales; "
        "torchao; needs an Ada/Hopper GPU and `pip install 'dicache[fp8]'`); weights stored in FP8 (default: none)",
    )
    group.add_argument(
        "--quantization-exclude",
        nargs="+",
        metavar="GROUP_OR_GLOB",
        default=None,
        help="block linears kept in bf16 under --quantization fp8, replacing the defaults: group names "
        f"({', '.join(LAYER_GROUPS)}) or glob patterns over module names, e.g. 'transformer_blocks.*.attn.to_gate'; "
        f"'{NO_EXCLUSIONS}': every block linear in FP8",
    )
    group.add_argument(
        "--text-encoder-quantization",
        choices=("none", *QUANTIZATION_METHODS),
        default="none",
        help="fp8: the text encoder's decoder-layer linears in FP8 too (as --quantization fp8; halves the text "
        "encoder's weights, about 3.6 GB less for Krea-2's; not with the memory options) (default: none)",
    )
    group.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the transformer blocks (the first generation at a new shape compiles; `dicache serve` "
        "does that at start-up for its default size)",
    )


def speed_spec(args: argparse.Namespace) -> Any:
    """The validated quantization of `args` (None: none), checked before any model is loaded (with the text
    encoder's: not together with the memory options, whose loading path quantizes the transformer only)."""
    from ..offload.cli import settings_from_args as offload_settings

    if text_encoder_quantization(args) is not None and offload_settings(args).any:
        raise QuantizationError(
            "--text-encoder-quantization cannot be combined with the memory options (--dit-layerwise-offload, "
            "--dit-cpu-offload, --text-encoder-cpu-offload, --vae-cpu-offload, --gpu-memory-budget)"
        )
    return parse_quantization(getattr(args, "quantization", None), getattr(args, "quantization_exclude", None))


def text_encoder_quantization(args: argparse.Namespace) -> str | None:
    """`--text-encoder-quantization` as a method name, or None."""
    method = getattr(args, "text_encoder_quantization", None)
    return None if method in (None, "none") else method


def apply_speed_options(pipe: Any, args: argparse.Namespace) -> None:
    """Quantize (if asked: the transformer, the text encoder), then compile (if asked) `pipe` in place."""
    spec = speed_spec(args)
    if spec is not None:
        pipe.quantize(spec)
    method = text_encoder_quantization(args)
    if method is not None:
        pipe.quantize_text_encoder(method)
    if getattr(args, "compile", False):
        pipe.compile()
