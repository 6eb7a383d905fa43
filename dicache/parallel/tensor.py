"""Tensor parallelism (Megatron style) for Krea-2's attention and SwiGLU modules, by module surgery.

Per `Attention`: `to_q`, `to_k`, `to_v` and `to_gate` keep the output rows of this rank's heads (column-parallel),
`to_out.0` keeps the matching input columns and all-reduces its partial sums (row-parallel); `num_heads` /
`num_kv_heads` become the local counts, so the model's own forward runs unchanged on `H / tp` heads. Per `SwiGLU`:
`gate`, `up` column-parallel, `down` row-parallel. Hidden states stay replicated on every rank of the TP group
(after each all-reduce); everything else (embeddings, modulation, norms, final layer) is replicated. Two all-reduces
per block change the summation order, so outputs equal one process within float rounding, not bitwise.

Weights are sliced from the full tensors already in the module (on any device, meta included) and copied, so the
full tensors are freed once the old modules are dropped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.krea2.transformer import Attention, SwiGLU


class RowParallelLinear(nn.Linear):
    """`y = all_reduce_sum(x_local @ W_local^T) (+ bias)`: the input features are split over `group`.

    x: `(..., in_features_local)`, this rank's share of the features; returns the full `(..., out_features)`,
    identical on every rank of the group.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group) -> None:
        with torch.device("meta"):
            super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None)
        self.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


def _linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def column_shard(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """A linear computing output features `[start, stop)` of `linear` (a copy of those weight rows)."""
    bias = linear.bias[start:stop].detach().clone() if linear.bias is not None else None
    return _linear_from(linear.weight[start:stop].detach().clone(), bias)


def row_shard(linear: nn.Linear, start: int, stop: int, group) -> RowParallelLinear:
    """A row-parallel linear reading input features `[start, stop)` of `linear` (a copy of those weight columns)."""
    bias = linear.bias.detach().clone() if linear.bias is not None else None
    return RowParallelLinear(
        linear.weight[:, start:stop].detach().clone(memory_format=torch.contiguous_format), bias, group
    )


def _share(total: int, rank: int, size: int) -> tuple[int, int]:
    per = total // size
    return rank * per, (rank + 1) * per


def shard_attention(attn: Attention, rank: int, size: int, group) -> None:
    """Keep query heads `[rank·H/size, (rank+1)·H/size)` and the K/V heads they read (GQA grouping is preserved)."""
    d = attn.head_dim
    q0, q1 = _share(attn.num_heads, rank, size)
    kv0, kv1 = _share(attn.num_kv_heads, rank, size)
    attn.to_q = column_shard(attn.to_q, q0 * d, q1 * d)
    attn.to_k = column_shard(attn.to_k, kv0 * d, kv1 * d)
    attn.to_v = column_shard(attn.to_v, kv0 * d, kv1 * d)
    attn.to_gate = column_shard(attn.to_gate, q0 * d, q1 * d)  # the gate multiplies the attention output per channel
    attn.to_out[0] = row_shard(attn.to_out[0], q0 * d, q1 * d, group)
    attn.num_heads, attn.num_kv_heads = q1 - q0, kv1 - kv0


def shard_swiglu(ff: SwiGLU, rank: int, size: int, group) -> None:
    """Keep hidden features `[rank·F/size, (rank+1)·F/size)` of the feed-forward."""
    f0, f1 = _share(ff.gate.out_features, rank, size)
    ff.gate = column_shard(ff.gate, f0, f1)
    ff.up = column_shard(ff.up, f0, f1)
    ff.down = row_shard(ff.down, f0, f1, group)


def tensor_parallel_problems(model: nn.Module, size: int) -> list[str]:
    """Why `model`'s attention / SwiGLU modules cannot be split `size` ways (empty: they can)."""
    problems = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            for what, count in (("query heads", module.num_heads), ("key/value heads", module.num_kv_heads)):
                if count % size:
                    problems.append(f"{name}: {count} {what} do not divide by tp {size}")
        elif isinstance(module, SwiGLU) and module.gate.out_features % size:
            problems.append(f"{name}: {module.gate.out_features} hidden features do not divide by tp {size}")
    return problems


def apply_tensor_parallel(model: nn.Module, rank: int, size: int, group) -> None:
    """Split every `Attention` and `SwiGLU` of `model` over the `size` ranks of `group`, in place.

    Check `tensor_parallel_problems` first: this assumes every count divides.
    """
    for module in list(model.modules()):
        if isinstance(module, Attention):
            shard_attention(module, rank, size, group)
        elif isinstance(module, SwiGLU):
            shard_swiglu(module, rank, size, group)
