"""8-bit weights and their emulation (docs/architecture.md §1, §9).

- `weights`: FP8 and INT8 linears through torchao for a loaded transformer and its text encoder (`QuantizationSpec`,
  `parse_quantization`, `quantize_transformer`, `quantize_text_encoder`); its names are re-exported here;
- `fp8_storage`: linears stored in FP8 and computed in the activation dtype (the text encoder's default);
- `joint_linears`: linears of one input joined into one GEMM (`join_linears`, `linear_outputs`);
- `hadamard`: orthogonal block-diagonal Hadamard rotations of a linear's input axis;
- `fp8_emulation`, `fp8_attention_emulation`: FP8 e4m3 and INT8 emulated in float32 on any device, for linears and
  for attention's two products (fidelity studies).

torchao is imported only by the functions that quantise with it, never by importing this package. The modules' paths
before they moved here (`dicache.fp8_storage`, `dicache.hadamard`, ...) still import: `dicache/__init__.py` names them.
"""

from .fp8_storage import store_linears_in_fp8
from .joint_linears import join_linears, joinable_groups, joint_name
from .weights import (
    DEFAULT_EXCLUDE,
    DEFAULT_FP8_EXCLUDE,
    DEFAULT_FP8_INCLUDE,
    FP8_ACTIVATION_FLOOR,
    FP8_MIN_CAPABILITY,
    INT8_MIN_CAPABILITY,
    JOIN_PROJECTIONS_DEFAULT,
    LAYER_GROUPS,
    NO_EXCLUSIONS,
    QUANTIZATION_METHODS,
    TEXT_ENCODER_FP8_INCLUDE,
    TEXT_ENCODER_QUANTIZATION_METHODS,
    QuantizationError,
    QuantizationSpec,
    check_fp8_support,
    check_int8_support,
    fp8_linears,
    int8_linears,
    join_selected,
    parse_quantization,
    quantize_text_encoder,
    quantize_transformer,
    selected_linears,
)

__all__ = [
    "DEFAULT_EXCLUDE",
    "DEFAULT_FP8_EXCLUDE",
    "DEFAULT_FP8_INCLUDE",
    "FP8_ACTIVATION_FLOOR",
    "FP8_MIN_CAPABILITY",
    "INT8_MIN_CAPABILITY",
    "JOIN_PROJECTIONS_DEFAULT",
    "LAYER_GROUPS",
    "NO_EXCLUSIONS",
    "QUANTIZATION_METHODS",
    "TEXT_ENCODER_FP8_INCLUDE",
    "TEXT_ENCODER_QUANTIZATION_METHODS",
    "QuantizationError",
    "QuantizationSpec",
    "check_fp8_support",
    "check_int8_support",
    "fp8_linears",
    "int8_linears",
    "join_linears",
    "join_selected",
    "joinable_groups",
    "joint_name",
    "parse_quantization",
    "quantize_text_encoder",
    "quantize_transformer",
    "selected_linears",
    "store_linears_in_fp8",
]
