"""8-bit attention on the GPU, the kernel behind `probe_fp8_attention.py`: one Triton program per (query block,
batch × query head), streaming the keys in blocks with an online softmax (flash attention's recurrence), computing
`dicache.fp8_attention_emulation`'s scheme. A measured candidate for issue 27, not part of the product: on an H200
(torch 2.11, Triton 3.6) its best configuration is 4 % slower than bf16 cuDNN attention (benchmarks/RESULTS.md,
2026-12-03 19:29).

Operands as `quantize_attention_inputs` returns them: q8 `(B, Hq, Sq, D)`, k8 `(B, Hkv, Sk, D)` in
int8 or float8_e4m3fn with float32 per-token scales `(B, H, S)` (Q's holding `log2(e)/sqrt(D)`); v8
`(B, Hkv, D, Sk)` float8_e4m3fn (or bfloat16) with float32 per-channel scales `(B, Hkv, D)`; key_mask `(B, Sk)`
bool or None. The last axis of every operand is contiguous. Output `(B, Hq, Sq, D)` in `out_dtype`.

`fp8_attention` is the whole call in `gqa_attention`'s contract: the operands' rounding in torch ops (which
`torch.compile` fuses into the ops before it) and the kernel as one custom op, opaque to the compiler.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dicache.quantization.fp8_attention_emulation import (  # noqa: E402
    Fp8AttentionScheme,
    fp8_attention_reference,
    quantize_attention_inputs,
)

E4M3_MAX = tl.constexpr(448.0)
"""Largest finite float8_e4m3fn value, as a constant the kernel can read."""


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch shape: `block_m` queries and `block_n` keys per step, `warps`, pipeline `stages`."""

    block_m: int = 128
    block_n: int = 128
    warps: int = 8
    stages: int = 3


DEFAULT_CONFIG = KernelConfig(64, 128, 4, 3)
"""The configuration `fp8_attention` launches: the fastest of `probe_fp8_attention.py`'s on an H200."""


@triton.jit
def _attention_forward(
    Q, K, V, Q_SCALE, K_SCALE, V_SCALE, KEY_MASK, OUT,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vd,
    stride_ob, stride_oh, stride_os,
    q_len, k_len, q_heads, group,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_INT8: tl.constexpr, PV_FP8: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // q_heads
    head = batch_head % q_heads
    kv_head = head // group
    kv_heads = q_heads // group

    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    channels = tl.arange(0, HEAD_DIM)
    row_ok = rows < q_len
    q = tl.load(
        Q + batch * stride_qb + head * stride_qh + rows[:, None] * stride_qs + channels[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    q_scale = tl.load(Q_SCALE + (batch * q_heads + head) * q_len + rows, mask=row_ok, other=0.0)

    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    k_scale_base = K_SCALE + (batch * kv_heads + kv_head) * k_len

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, k_len, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < k_len
        k = tl.load(k_base + cols[None, :] * stride_ks + channels[:, None], mask=col_ok[None, :], other=0.0)
        k_scale = tl.load(k_scale_base + cols, mask=col_ok, other=0.0)
        if QK_INT8:
            scores = tl.dot(q, k, out_dtype=tl.int32).to(tl.float32)
        else:
            scores = tl.dot(q, k)
        scores = scores * q_scale[:, None] * k_scale[None, :]
        if HAS_MASK:
            col_ok = col_ok & (tl.load(KEY_MASK + batch * k_len + cols, mask=col_ok, other=0) != 0)
        scores = tl.where(col_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with no valid key yet
        probs = tl.math.exp2(scores - safe_max[:, None])
        decay = tl.math.exp2(running_max - safe_max)
        row_sum = row_sum * decay + tl.sum(probs, 1)
        v = tl.load(v_base + channels[None, :] * stride_vd + cols[:, None], mask=col_ok[:, None], other=0.0)
        if PV_FP8:
            acc = tl.dot((probs * E4M3_MAX).to(tl.float8e4nv), v, acc * decay[:, None])
        else:
            acc = tl.dot(probs.to(v.dtype), v, acc * decay[:, None])
        running_max = new_max

    v_scale = tl.load(V_SCALE + (batch * kv_heads + kv_head) * HEAD_DIM + channels)
    if PV_FP8:
        v_scale = v_scale / E4M3_MAX
    out = acc * v_scale[None, :] / row_sum[:, None]
    tl.store(
        OUT + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + channels[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None],
    )


def launch(
    q8: torch.Tensor,
    q_scale: torch.Tensor,
    k8: torch.Tensor,
    k_scale: torch.Tensor,
    v8: torch.Tensor,
    v_scale: torch.Tensor,
    key_mask: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: KernelConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Run the kernel on the module doc's operands; returns `(B, Hq, Sq, D)` in `out_dtype`."""
    batch, q_heads, q_len, head_dim = q8.shape
    k_len = k8.shape[2]
    out = torch.empty((batch, q_heads, q_len, head_dim), dtype=out_dtype, device=q8.device)
    mask = key_mask if key_mask is not None else q_scale  # any tensor; unread without HAS_MASK
    grid = (triton.cdiv(q_len, config.block_m), batch * q_heads)
    _attention_forward[grid](
        q8, k8, v8, q_scale, k_scale, v_scale, mask, out,
        q8.stride(0), q8.stride(1), q8.stride(2),
        k8.stride(0), k8.stride(1), k8.stride(2),
        v8.stride(0), v8.stride(1), v8.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        q_len, k_len, q_heads, q_heads // k8.shape[1],
        HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        QK_INT8=q8.dtype == torch.int8, PV_FP8=v8.dtype == torch.float8_e4m3fn, HAS_MASK=key_mask is not None,
        num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return out


@torch.library.custom_op("dicache::fp8_attention_kernel", mutates_args=())
def _kernel(
    q8: torch.Tensor,
    q_scale: torch.Tensor,
    k8: torch.Tensor,
    k_scale: torch.Tensor,
    v8: torch.Tensor,
    v_scale: torch.Tensor,
    key_mask: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return launch(q8, q_scale, k8, k_scale, v8, v_scale, key_mask, out_dtype)


@_kernel.register_fake
def _(q8, q_scale, k8, k_scale, v8, v_scale, key_mask, out_dtype):
    return q8.new_empty(q8.shape, dtype=out_dtype)


def fp8_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    scheme: Fp8AttentionScheme | None = None,
) -> torch.Tensor:
    """Attention with 8-bit products in `gqa_attention`'s contract: on CUDA the kernel (module doc), elsewhere
    `fp8_attention_reference`. `scheme` None: `Fp8AttentionScheme()`."""
    scheme = scheme or Fp8AttentionScheme()
    if not query.is_cuda:
        return fp8_attention_reference(query, key, value, key_mask, scheme)
    operands = quantize_attention_inputs(query, key, value, scheme)
    return _kernel(*operands, key_mask, query.dtype)
