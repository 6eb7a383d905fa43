"""Which tokens a cached step computes (`cached_step_method=tokens`) and what that costs: pure tensor maths.

A cached call computes a fixed count of the rows of the stream entering the skipped blocks (`token_count`: a share of
the sequence, so shapes stay static under `torch.compile`): those whose input moved most since the last computed call
(`select_rows`, the L2 norm of the change per row, summed over the batch, so every batch item computes the same
rows). They run through every skipped block as queries against all keys: their own fresh keys and values, the other
rows' kept from the last computed call. The rest of the rows get the forecaster's estimate.

`subset_fraction` is the share of a block's FLOPs that costs (projections and feed-forward of `k` rows, attention of
`k` queries against all `S` keys; norms, RoPE and the row gathers are not counted): what `RequestStats.blocks_run`
adds for such a block.
"""

from __future__ import annotations

import torch


def token_count(seq_len: int, share: float) -> int:
    """Rows a cached call computes of a `seq_len`-row stream: `round(share · seq_len)`, at least 1 and at most
    `seq_len − 1`."""
    return min(max(1, round(share * seq_len)), max(1, seq_len - 1))


def select_rows(source: torch.Tensor, previous: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` rows (axis 1 of `(B, S, C)`) whose input changed most from `previous` to `source`, by the L2 norm
    of the change summed over the batch; int64 `(count,)` ascending, on `source`'s device (no host sync)."""
    change = (source.float() - previous.float()).square().sum(dim=-1).sqrt().sum(dim=0)
    return torch.topk(change, count, sorted=False).indices.sort().values


def subset_fraction(rows: int, seq_len: int, linear_macs: float, attention_width: int) -> float:
    """FLOPs of a block computing `rows` of `seq_len` rows as queries against all keys, over a full block's:
    `(rows · 2·linear_macs + 4·rows·seq_len·width) / (seq_len · 2·linear_macs + 4·seq_len²·width)`, with
    `linear_macs` the block's multiply-adds per row in its linears and `width` the query width (heads × head dim)."""
    full = seq_len * 2 * linear_macs + 4 * seq_len * seq_len * attention_width
    part = rows * 2 * linear_macs + 4 * rows * seq_len * attention_width
    return part / full if full else 1.0
