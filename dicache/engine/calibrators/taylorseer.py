"""TaylorSeer: extrapolate the middle residual from the last computed steps with divided differences.

Keeps the Newton ladder `D0 = M(x0)`, `D(k+1) = (Dk(x0) − Dk(x1)) / (x0 − x(k+1))` over the most recent computed
positions `x0 > x1 > …` (or decreasing sigmas), and estimates `M̂(c) = Σ_k Dk · Π_{j<k} (c − xj)`: the polynomial
through the last `order + 1` computed residuals, so it is exact on polynomial sequences of its order at any spacing.
For order 1 this is the reference TaylorSeer step (`D0 + D1·(c − x0)`, `D1 = (M(x0) − M(x1)) / (x0 − x1)`); for order
2 the reference divides every level by the last gap and uses `(c − x0)^k / k!`, which is exact only for linear
sequences. The ladder is usable as soon as two computed steps exist (order 1 from the 2nd computed step; order 2
falls back to order 1 until the 3rd), not from the 4th as in the reference implementation.
`damping` (0..1) scales every extrapolation term (`D0 + damping·Σ_{k≥1} …`): a damped TaylorSeer that trusts the
trend less, which measured better than the plain one when steps are far apart (whole-step reuse, sparse masks).
Memory: `order + 1` residual-sized tensors.
"""

from __future__ import annotations

import torch


class TaylorSeerCalibrator:
    """Newton-form TaylorSeer of order 1 or 2 over step indices or sigmas, optionally damped."""

    def __init__(self, order: int = 1, damping: float = 1.0) -> None:
        if order not in (1, 2):
            raise ValueError(f"taylorseer_order={order!r} is invalid: must be 1 or 2")
        if not 0.0 <= damping <= 1.0:
            raise ValueError(f"taylorseer_damping={damping!r} is invalid: must be in [0, 1]")
        self.order = order
        self.damping = damping
        self._ladder: list[torch.Tensor] = []  # D0, D1, … for the current anchor x0
        self._nodes: list[float] = []  # x0, x1, … (most recent first), at most `order` kept

    def update(self, x: float, residual: torch.Tensor, source: torch.Tensor | None = None) -> None:
        if self._nodes and x == self._nodes[0]:  # the same position computed again: start over from it
            self.reset()
        ladder = [residual]
        for k in range(min(self.order, len(self._ladder))):
            ladder.append((ladder[k] - self._ladder[k]) / (x - self._nodes[k]))
        self._ladder = ladder
        self._nodes = ([x] + self._nodes)[: self.order]

    def estimate(self, x: float, source: torch.Tensor | None = None) -> torch.Tensor:
        if not self._ladder:
            raise RuntimeError("TaylorSeerCalibrator.estimate called before any computed step")
        out = self._ladder[0]
        weight = 1.0
        for k in range(1, len(self._ladder)):
            weight *= x - self._nodes[k - 1]
            out = out + self._ladder[k] * (weight * self.damping)
        return out

    def _trend(self, x: float) -> torch.Tensor | None:
        """The undamped extrapolation terms `Σ_{k≥1} Dk · Π_{j<k}(x − xj)`; None with fewer than two nodes."""
        out = None
        weight = 1.0
        for k in range(1, len(self._ladder)):
            weight *= x - self._nodes[k - 1]
            term = self._ladder[k] * weight
            out = term if out is None else out + term
        return out

    @property
    def ready(self) -> bool:
        return bool(self._ladder)

    @property
    def stored_tensors(self) -> int:
        return len(self._ladder)

    def reset(self) -> None:
        self._ladder, self._nodes = [], []
