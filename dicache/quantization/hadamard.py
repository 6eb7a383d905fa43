"""Orthogonal Hadamard rotations of a linear layer's input axis: spread outliers before FP8 quantisation.

A linear `y = x Wᵀ` is unchanged when its input and its weight rows are turned by the same orthogonal matrix `R`:
`y = (x R)(W R)ᵀ`. With `R` a normalised Hadamard matrix every rotated coordinate mixes all coordinates of its block
with equal weight, so a few large channels (outliers) no longer dominate a row's FP8 scale (QuaRot-style). `W R` is
computed once, offline; `x R` at run time.

`HadamardRotation(k)` is block-diagonal over the `k` input features: `k / b` blocks of size `b`, the largest power of
two dividing `k` up to `max_block`. Each block's Hadamard is applied as a Kronecker product of two Sylvester
Hadamards (`b = f1 · f2`, `H_b = H_f1 ⊗ H_f2`), i.e. two small matrix products instead of one `b × b` product. The
normalised Sylvester matrices are symmetric and orthogonal, so `R = Rᵀ = R⁻¹` and applying the rotation twice is the
identity (exact up to float rounding).
"""

from __future__ import annotations

import math

import torch

DEFAULT_MAX_BLOCK = 2048
"""Largest rotation block: 6144-wide Krea-2 inputs rotate in 3 blocks of 2048, 16384-wide ones in 8."""


def hadamard_matrix(
    n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix `(n, n)` (entries ±1/√n; symmetric, orthogonal); `n` a power of 2."""
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n={n!r} is invalid: must be a power of two >= 1")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def block_size(features: int, max_block: int = DEFAULT_MAX_BLOCK) -> int:
    """The rotation block for `features` inputs: the largest power of two dividing it, at most `max_block`."""
    if features < 1 or max_block < 1:
        raise ValueError(f"block_size: features={features} and max_block={max_block} must be >= 1")
    return min(features & -features, 1 << (max_block.bit_length() - 1))


class HadamardRotation:
    """`x ↦ x R` over the last axis of `x` (`features` wide), `R` block-diagonal with Hadamard blocks (module doc).

    `factors`: the two Sylvester sizes whose product is the block (`f1 ≤ f2`). `matrices(dtype, device)` gives the
    two factor matrices to keep beside a module (e.g. as buffers); `apply(x, h1, h2)` rotates with them.
    """

    def __init__(self, features: int, max_block: int = DEFAULT_MAX_BLOCK) -> None:
        self.features = int(features)
        self.block = block_size(self.features, max_block)
        f1 = 1 << (self.block.bit_length() - 1) // 2
        self.factors = (f1, self.block // f1)

    def matrices(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return hadamard_matrix(self.factors[0], dtype, device), hadamard_matrix(self.factors[1], dtype, device)

    def apply(self, x: torch.Tensor, h1: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
        """`x` `(..., features)` rotated, same shape and dtype (`h1`, `h2` from `matrices`, in `x`'s dtype)."""
        if x.shape[-1] != self.features:
            raise ValueError(f"HadamardRotation: input has {x.shape[-1]} features, expected {self.features}")
        blocks = x.unflatten(-1, (self.features // self.block, *self.factors))  # (..., nblocks, f1, f2)
        return torch.matmul(h1, blocks @ h2).flatten(-3)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate `x` in float32 (the offline path: weights); returns `x`'s dtype."""
        h1, h2 = self.matrices(torch.float32, x.device)
        return self.apply(x.float(), h1, h2).to(x.dtype)

    def __repr__(self) -> str:
        return f"HadamardRotation(features={self.features}, block={self.block}, factors={self.factors})"
