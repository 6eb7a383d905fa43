"""Working-memory estimates for the memory planner (pure arithmetic on model sizes; upper bounds for eager runs).

Each counts the tensors alive at the worst moment of a phase, in bytes, with `element_bytes` the activation dtype's
size (2 for bf16). The benchmark (`benchmarks/bench_offload.py`) prints the planned peak beside the measured one.
"""

from __future__ import annotations

from collections.abc import Sequence

DIT_HIDDEN_COPIES = 12
"""Hidden-size tensors alive at a transformer call's peak: the residual streams the stack and the cache hold (input,
Fn output, current, Fn residual), the block's own (input, normed and modulated copies, fp32 norm temporaries counted
twice, attention projections, gate) — an upper bound over the attention and feed-forward halves."""
DIT_FF_COPIES = 3
"""Feed-forward-width tensors alive at the feed-forward peak: SiLU(gate), up, and their product."""


def dit_activation_bytes(hidden_size: int, intermediate_size: int, rows: int, tokens: int, element_bytes: int) -> int:
    """Peak working memory of one transformer call over `rows` sequences of `tokens` tokens (text + image)."""
    return rows * tokens * element_bytes * (DIT_HIDDEN_COPIES * hidden_size + DIT_FF_COPIES * intermediate_size)


def cache_bytes(
    hidden_size: int,
    rows: int,
    tokens: int,
    element_bytes: int,
    stored_per_row: int,
    rows_per_call: int,
) -> int:
    """Residuals the cache keeps for a request: `stored_per_row` hidden-state tensors per row of every branch
    (`rows` over all branches), plus the two it computes during a call (`rows_per_call` rows)."""
    return tokens * hidden_size * element_bytes * (rows * stored_per_row + 2 * rows_per_call)


def stored_residuals_per_row(uses_diff: bool, taylorseer_order: int | None) -> int:
    """Hidden-state tensors the cache stores per row: the Fn residual when decisions read the diff, plus the
    calibrator's terms (plain reuse 1, TaylorSeer order k: k + 1)."""
    terms = 1 if taylorseer_order is None else taylorseer_order + 1
    return terms + (1 if uses_diff else 0)


def text_encoder_activation_bytes(
    num_layers: int, hidden_size: int, intermediate_size: int, rows: int, tokens: int, taps: int, element_bytes: int
) -> int:
    """A causal text encoder asked for every hidden state: all `num_layers + 1` outputs, the `taps` stacked ones,
    and one layer's MLP temporaries (4 intermediate-width tensors)."""
    return rows * tokens * element_bytes * ((num_layers + 1 + taps) * hidden_size + 4 * intermediate_size)


def vae_decode_bytes(
    z_dim: int,
    base_dim: int,
    dim_mult: Sequence[int],
    latent_height: int,
    latent_width: int,
    rows: int,
    element_bytes: int,
) -> int:
    """Qwen-Image-style decoder (mid block at the latent size, then x2 up-sampling stages halving channels): six
    copies of its largest feature map (input, fp32 norm temporaries, activation, conv output), plus the mid block's
    single-head attention scores over the latent positions (two `positions²` matrices when no fused kernel applies)."""
    dims = [base_dim * m for m in (dim_mult[-1], *reversed(dim_mult))]
    area = latent_height * latent_width
    largest = z_dim * area
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
        in_dim = in_dim if i == 0 else in_dim // 2
        largest = max(largest, in_dim * area, out_dim * area)
        if i < len(dim_mult) - 1:  # up-sampled to 4x the area, then a conv halving the channels
            area *= 4
            largest = max(largest, out_dim * area)
    return rows * element_bytes * (6 * largest + 2 * (latent_height * latent_width) ** 2)
