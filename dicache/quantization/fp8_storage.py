"""Linear layers whose weights are stored in FP8 e4m3 and multiplied in the activation dtype: half a bf16 weight's
bytes, for a module that runs once per request (Krea-2's text encoder, `--text-encoder-quantization fp8`).

`Float8StoredLinear` computes `y = (x @ q.T) * s + b`:

- `q = e4m3(W / s)` is the stored weight `(out, in)`, and `s` one scale per output channel `(out, 1)`, float32;
- each scale is the power of two that brings its row's largest magnitude into (224, 448] (448 is e4m3's largest
  value). A power of two changes only the exponent of a floating-point value, so it costs no precision against the
  exact `max|W_row| / 448`, and multiplying by it is exact in any float dtype;
- converting e4m3 to bf16 or float32 is exact, so a call is one conversion pass over the weight (1 byte read and
  2 written per weight in bf16) and an ordinary GEMM; the scale multiplies the output, which is far smaller than the
  weight at a few hundred tokens.

Compiled (`compile_stored_linears`, which `pipe.compile()` applies with the text encoder's CUDA graphs), the
conversion is one Triton pass at memory speed, where PyTorch's eager e4m3 -> bf16 copy converts in software (11.1 of
the 27.6 GPU milliseconds of an FP8-stored full-size encode on an H200, benchmarks/RESULTS.md 2026-12-03 17:15), and
the scale and bias fold into one pass over the output. The values are the eager ones: the conversion is exact either
way and the scale a power of two.

Why not torchao's weight-only FP8: it dequantises through float32 (about four times the memory traffic), which made
the text encoder's encode 2.6× slower than bf16 on an H200 once its launches were gone (CUDA graphs: 44.8 against
17.5 ms, benchmarks/RESULTS.md 2026-12-03 15:26).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
"""448: e4m3's largest finite value."""


def power_of_two_scales(weight: torch.Tensor) -> torch.Tensor:
    """`(out, in)` weight -> `(out, 1)` float32 scales: per row, the smallest power of two `s` with
    `max|row| / s <= 448`. An all-zero row gets the scale of the tiniest normal float32 (its weights stay zeros)."""
    amax = weight.detach().abs().amax(dim=1, keepdim=True).float()
    amax = amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))


def stored_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`Float8StoredLinear`'s arithmetic: `x (..., in)` -> `(x @ weight.T) * scale + bias` `(..., out)` in x's dtype;
    weight `(out, in)` e4m3, scale `(out, 1)` float32, bias `(out,)` or None."""
    y = F.linear(x, weight.to(x.dtype)) * scale.view(-1).to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


_compiled: dict[object, Callable[..., torch.Tensor]] = {}


def compiled_stored_linear(backend: str | Callable = "inductor") -> Callable[..., torch.Tensor]:
    """`stored_linear` under `torch.compile` (shapes symbolic: one graph serves every layer and token count), one
    per backend, shared by all the layers of the process."""
    if backend not in _compiled:
        _compiled[backend] = torch.compile(stored_linear, backend=backend, dynamic=True, fullgraph=True)
    return _compiled[backend]


class Float8StoredLinear(nn.Module):
    """A linear layer with its weight stored as FP8 e4m3 plus a float32 power-of-two scale per output channel (module
    docstring). Buffers: `weight` `(out, in)` float8_e4m3fn, `scale` `(out, 1)` float32, `bias` `(out,)` or None.
    Input `(..., in)` in any float dtype -> output `(..., out)` in that dtype. Inference only (no gradients)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2 or scale.shape != (weight.shape[0], 1):
            raise ValueError(
                f"Float8StoredLinear: weight {tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)}; "
                "expected a 2-D float8_e4m3fn weight (out, in) and a (out, 1) scale"
            )
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.arithmetic: Callable[..., torch.Tensor] = stored_linear
        """`stored_linear` or its compiled form (`compile_stored_linears`)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8StoredLinear:
        """The FP8-stored copy of `linear` (on its device; `bias` kept in its dtype)."""
        weight = linear.weight.detach()
        scale = power_of_two_scales(weight)
        quantized = (weight.float() / scale).to(torch.float8_e4m3fn)  # |value| <= 448: no overflow to NaN
        return cls(quantized, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.arithmetic(x, self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def store_linears_in_fp8(model: nn.Module, names: set[str]) -> None:
    """Replace the `nn.Linear`s of `model` named in `names` by `Float8StoredLinear` copies, in place; their bf16 /
    float32 weights are freed (on CUDA the allocator's cache is emptied so that the bytes go back)."""
    for name in sorted(names):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"store_linears_in_fp8: {name} is a {type(linear).__name__}, not an nn.Linear")
        setattr(parent, child, Float8StoredLinear.from_linear(linear))
        del linear
    if any(t.is_cuda for t in model.buffers()):
        torch.cuda.empty_cache()


def compile_stored_linears(model: nn.Module, backend: str | Callable = "inductor") -> int:
    """Run every `Float8StoredLinear` of `model` through `compiled_stored_linear(backend)` (module docstring: why);
    returns how many. The first call at a new input rank or batch of 1 compiles; the values stay the eager ones."""
    layers = [m for m in model.modules() if isinstance(m, Float8StoredLinear)]
    for layer in layers:
        layer.arithmetic = compiled_stored_linear(backend)
    return len(layers)
