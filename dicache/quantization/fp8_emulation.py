"""FP8 e4m3 (or INT8) linears emulated in float32 on any device: what such a GEMM computes, for fidelity studies on a
CPU.

`fake_quantize(x, block)` views `x` as a matrix `(rows, cols)` (the last axis is `cols`), splits it into blocks of
`block = (block_rows, block_cols)` (0 = the whole axis; partial blocks at the edges are allowed), scales each block so
that its largest magnitude maps to `E4M3_MAX`, rounds to `torch.float8_e4m3fn` (round to nearest even) and scales
back, as torchao's dynamic FP8 does (`scale = amax / 448`, `x / scale` clamped to ±448, cast). Granularities in
torchao's terms: activations per row `(1, 0)` or per 1×128 block `(1, 128)`; weights `(out, in)` per output channel
`(1, 0)` or per 128×128 block `(128, 128)`. With `fmt="int8"` the same blocks are rounded to symmetric INT8 instead,
as torchao's dynamic INT8 does (`scale = amax / 127.5`, round half to even, clamped to [-128, 127]).

`emulate_fp8(model, names, scheme)` makes the named `nn.Linear`s compute `fake_quantize(x) · fake_quantize(W)ᵀ` in
float32 (exact accumulation) and return their input dtype. Not emulated: the GPU's accumulation order and, under
torchao's default fast accumulation on Hopper, its reduced-precision accumulator over long inputs.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .hadamard import HadamardRotation

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
"""Largest finite float8_e4m3fn value (448)."""

INT8_RANGE = (-128, 127)
"""torchao's symmetric INT8 range; its scale is `amax / ((127 - -128) / 2)`."""

FORMATS = ("e4m3", "int8")
"""Number formats `fake_quantize` emulates."""

PER_ROW = (1, 0)
ACTIVATION_BLOCK = (1, 128)
WEIGHT_BLOCK = (128, 128)


def block_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """The scale that maps a block's largest magnitude `amax` onto `fmt`'s largest value (`E4M3_MAX`, or 127.5 for
    int8 as torchao takes it); 1 where `amax` is 0, so an all-zero block stays zeros."""
    low, high = INT8_RANGE
    scale = amax / (E4M3_MAX if fmt == "e4m3" else (high - low) / 2)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def round_scaled(scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """Values already divided by their `block_scale`, rounded to `fmt` and returned in its dtype: float8_e4m3fn
    (clamped to ±`E4M3_MAX`, round to nearest even) or int8 (round half to even, clamped to `INT8_RANGE`)."""
    if fmt == "e4m3":
        return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return scaled.round().clamp(*INT8_RANGE).to(torch.int8)


def fake_quantize(x: torch.Tensor, block: tuple[int, int] = PER_ROW, fmt: str = "e4m3") -> torch.Tensor:
    """`x` rounded through `fmt` (float8_e4m3fn or int8) with one scale per block (module doc); float32, `x`'s
    shape."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} is invalid: must be one of {', '.join(FORMATS)}")
    matrix = x.reshape(-1, x.shape[-1]).float()
    rows, cols = matrix.shape
    block_rows, block_cols = block[0] or rows, block[1] or cols
    pad_rows, pad_cols = -rows % block_rows, -cols % block_cols
    padded = F.pad(matrix, (0, pad_cols, 0, pad_rows))
    tiles = padded.reshape(padded.shape[0] // block_rows, block_rows, padded.shape[1] // block_cols, block_cols)
    scale = block_scale(tiles.abs().amax(dim=(1, 3), keepdim=True), fmt)
    quantized = round_scaled(tiles / scale, fmt).float() * scale
    return quantized.reshape(padded.shape)[:rows, :cols].reshape(x.shape)


@dataclass(frozen=True)
class EmulatedScheme:
    """How an emulated linear scales its operands: block shapes for the activation and the weight, an optional
    Hadamard rotation of the input axis (`hadamard`, blocks of at most `rotation_block` features) applied to both
    before quantising (`x R` and `W R`; exact without quantisation), and the number format (`FORMATS`)."""

    activation_block: tuple[int, int] = PER_ROW
    weight_block: tuple[int, int] = PER_ROW
    rotation_block: int | None = None
    fmt: str = "e4m3"


def _emulated_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    inputs = x.float() if self.fp8_rotation is None else self.fp8_rotation(x.float())
    out = fake_quantize(inputs, self.fp8_scheme.activation_block, self.fp8_scheme.fmt) @ self.fp8_weight.t()
    if self.bias is not None:
        out = out + self.bias.float()
    return out.to(x.dtype)


def emulate_fp8(model: nn.Module, names: Iterable[str], scheme: EmulatedScheme = EmulatedScheme()) -> list[str]:
    """Make the named linears of `model` compute in emulated FP8 (module doc), in place; returns the names.

    The weight is fake-quantised once (kept beside it as `fp8_weight`, float32); `restore_linears` undoes it."""
    modules = dict(model.named_modules())
    done = []
    for name in names:
        linear = modules[name]
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"emulate_fp8: {name} is a {type(linear).__name__}, not an nn.Linear")
        linear.fp8_scheme = scheme
        weight = linear.weight.detach().float()
        linear.fp8_rotation = None
        if scheme.rotation_block is not None:
            linear.fp8_rotation = HadamardRotation(weight.shape[1], scheme.rotation_block)
            weight = linear.fp8_rotation(weight)
        linear.fp8_weight = fake_quantize(weight, scheme.weight_block, scheme.fmt)
        linear.forward = types.MethodType(_emulated_forward, linear)
        done.append(name)
    return done


def restore_linears(model: nn.Module) -> None:
    """Undo `emulate_fp8` on every linear of `model`."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and "fp8_weight" in vars(module):
            del module.forward, module.fp8_weight, module.fp8_scheme, module.fp8_rotation
