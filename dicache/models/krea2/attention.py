"""The attention kernel of the Krea-2 transformer, in one place so it can be swapped or tuned.

Layout `(batch, heads, seq, head_dim)`; grouped-query attention: query head `h` reads key/value head
`h // (q_heads // kv_heads)`, the same grouping as repeating each K/V head `q_heads // kv_heads` times.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPE_FREE_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""SDPA backends with no set-up per input shape, in order of preference. cuDNN's attention (torch's first choice on
Hopper) builds a plan for each new shape, 50-75 ms on an H200 and again on each thread (benchmarks/RESULTS.md,
`probe_sdpa_plans.py`): right for the transformer blocks, whose shape changes only with the prompt length and which
run it dozens of times per request, but not for the text path, which runs once per request at the prompt's length."""


def gqa_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention with scale `1/sqrt(head_dim)`.

    query: `(B, Hq, Sq, D)`; key, value: `(B, Hkv, Sk, D)` with `Hq % Hkv == 0`; key_mask: `(B, Sk)` bool, True for
    keys that may be attended to, or None (all keys valid). Returns `(B, Hq, Sq, D)` in the query's dtype.

    Without a mask, SDPA runs with `enable_gqa` so K/V are never repeated and the flash / cuDNN kernels apply. With a
    mask, the query heads that share a K/V head are folded into the query axis, `(B, Hkv, G*Sq, D)`: a plain
    multi-head call that every masked kernel accepts, costing one copy of Q instead of `G` copies of K and V.
    """
    q_heads, kv_heads = query.shape[1], key.shape[1]
    if key_mask is None:
        return F.scaled_dot_product_attention(query, key, value, enable_gqa=q_heads != kv_heads)
    batch, _, q_len, head_dim = query.shape
    folded = query.reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, head_dim)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=key_mask[:, None, None, :])
    return out.reshape(batch, q_heads, q_len, head_dim)


def shape_free_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`gqa_attention` restricted on CUDA to `SHAPE_FREE_BACKENDS`: the same contract and result up to the kernels'
    rounding, with no first-call cost at a new shape (elsewhere it is `gqa_attention`). The text path's kernel."""
    if not query.is_cuda:
        return gqa_attention(query, key, value, key_mask)
    with sdpa_kernel(list(SHAPE_FREE_BACKENDS)):
        return gqa_attention(query, key, value, key_mask)
