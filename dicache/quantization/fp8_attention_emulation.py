"""Softmax attention with 8-bit matrix products (SageAttention-style), emulated in float32 on any device, for
fidelity studies (`benchmarks/bench_fp8.py --emulate ...+attention:int8`): the scheme, its operands' rounding, and a
reference that computes what the Triton kernel of `experiments/fp8_attention_kernel.py` computes, up to accumulation
order. Measured and not adopted (benchmarks/RESULTS.md, 2026-12-03 19:25 and 19:29): on the embedded checkpoint it
costs 1.2 dB on Raw 28 on top of the FP8 linears, and on an H200 the kernel is no faster than bf16 cuDNN attention.

Layout as `dicache.models.krea2.attention.gqa_attention`: query `(B, Hq, Sq, D)`, key / value `(B, Hkv, Sk, D)`,
`Hq % Hkv == 0`, key_mask `(B, Sk)` bool (True: may be attended to) or None; scale `1/sqrt(D)`.

The scheme (`Fp8AttentionScheme`):
- scores `Q Kᵀ`: K is first smoothed by subtracting its mean over the keys (per head and channel; every score of a
  query row moves by the same `q · mean`, so softmax is unchanged), then Q and K are rounded to `qk_fmt` (INT8 or
  e4m3) with one scale per token (a row of `D` values); the product accumulates in int32 / float32 and is rescaled by
  the two scales;
- `P V`: the probabilities `P = exp(s - running max)`, in [0, 1], are multiplied by `E4M3_MAX` and rounded to e4m3;
  V is rounded to e4m3 with one scale per (head, channel) over the keys; the product accumulates in float32 and is
  divided by the row sum of the unrounded `P` (and by `E4M3_MAX`) and multiplied by V's channel scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .fp8_emulation import E4M3_MAX, FORMATS, block_scale, round_scaled

QK_FORMATS = FORMATS
"""Number formats the scores' operands may be rounded to."""

PV_FORMATS = ("e4m3", "bf16")
"""Number formats of the `P V` product's operands: e4m3 (module doc), or P and V in bfloat16 (V unscaled)."""


@dataclass(frozen=True)
class Fp8AttentionScheme:
    """How 8-bit attention rounds its operands (module doc): `qk_fmt` for Q and K, `smooth_k` to subtract K's mean
    over the keys first, `pv_fmt` for P and V, and `v_per_channel` for one V scale per (head, channel) instead of
    one per head (e4m3 only)."""

    qk_fmt: str = "int8"
    smooth_k: bool = True
    pv_fmt: str = "e4m3"
    v_per_channel: bool = True

    def __post_init__(self) -> None:
        if self.qk_fmt not in QK_FORMATS:
            raise ValueError(f"qk_fmt={self.qk_fmt!r} is invalid: must be one of {', '.join(QK_FORMATS)}")
        if self.pv_fmt not in PV_FORMATS:
            raise ValueError(f"pv_fmt={self.pv_fmt!r} is invalid: must be one of {', '.join(PV_FORMATS)}")


def _round_rows(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (..., D) rounded per row: (values in `fmt`'s dtype: int8 or float8_e4m3fn, scales float32 (...,))."""
    xf = x.float()
    scale = block_scale(xf.abs().amax(dim=-1), fmt)
    return round_scaled(xf / scale[..., None], fmt), scale


def quantize_attention_inputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scheme: Fp8AttentionScheme
) -> tuple[torch.Tensor, ...]:
    """The kernel's operands: `(q8, q_scale, k8, k_scale, v8, v_scale)`.

    q8 `(B, Hq, Sq, D)` and k8 `(B, Hkv, Sk, D)` in int8 / float8_e4m3fn with float32 scales `(B, H, S)`; `q_scale`
    includes the softmax scale `1/sqrt(D)` and `log2(e)` (the kernel exponentiates base 2). v8 `(B, Hkv, D, Sk)`
    float8_e4m3fn (bfloat16 with `pv_fmt="bf16"`), transposed so each channel is contiguous over the keys (both
    operands of an FP8 tensor-core product must be contiguous along the reduced axis), with float32 `v_scale`
    `(B, Hkv, D)` (ones for bf16)."""
    head_dim = query.shape[-1]
    if scheme.smooth_k:
        key = key - key.float().mean(dim=2, keepdim=True).to(key.dtype)
    q8, q_scale = _round_rows(query, scheme.qk_fmt)
    k8, k_scale = _round_rows(key, scheme.qk_fmt)
    q_scale = q_scale * (math.log2(math.e) / math.sqrt(head_dim))
    if scheme.pv_fmt == "bf16":
        v_scale = torch.ones(value.shape[:2] + value.shape[3:], dtype=torch.float32, device=value.device)
        return q8, q_scale, k8, k_scale, value.to(torch.bfloat16).transpose(2, 3).contiguous(), v_scale
    vf = value.float()
    amax = vf.abs().amax(dim=2)  # (B, Hkv, D)
    if not scheme.v_per_channel:
        amax = amax.amax(dim=-1, keepdim=True).expand_as(amax)
    v_scale = block_scale(amax, "e4m3").contiguous()
    v8 = round_scaled(vf / v_scale[:, :, None, :], "e4m3").transpose(2, 3).contiguous()
    return q8, q_scale, k8, k_scale, v8, v_scale


def fp8_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    scheme: Fp8AttentionScheme = Fp8AttentionScheme(),
) -> torch.Tensor:
    """What the kernel computes (module doc), in float32 with whole rows (the kernel's running max only changes
    which power of two P is measured against); returns the query's dtype and shape."""
    q8, q_scale, k8, k_scale, v8, v_scale = quantize_attention_inputs(query, key, value, scheme)
    group = query.shape[1] // key.shape[1]
    qf = q8.float() * q_scale[..., None]
    kf = (k8.float() * k_scale[..., None]).repeat_interleave(group, dim=1)
    scores = qf @ kf.transpose(-1, -2)  # base-2 logits
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    probs = torch.exp2(scores - scores.amax(dim=-1, keepdim=True))
    if scheme.pv_fmt == "bf16":
        rounded, top = probs.to(torch.bfloat16).float(), 1.0
    else:
        rounded, top = (probs * E4M3_MAX).to(torch.float8_e4m3fn).float(), E4M3_MAX
    vf = v8.float().transpose(2, 3).repeat_interleave(group, dim=1)
    out = (rounded @ vf) / (probs.sum(dim=-1, keepdim=True) * top)
    out = out * v_scale.repeat_interleave(group, dim=1)[:, :, None, :]
    return out.to(query.dtype)
