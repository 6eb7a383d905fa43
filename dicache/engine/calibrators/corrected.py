"""Corrected TaylorSeer: a predictor–corrector that re-fits the trend's gain at every computed step.

Predictor: the Newton-form TaylorSeer estimate `M̂(c) = D0 + g · T(c)`, `T(c) = Σ_{k≥1} Dk · Π_{j<k}(c − xj)`.
Corrector: when a computed step at `x` arrives and a trend exists, the forecast the calibrator would have made there is
compared with the computed residual `M(x)`, and the gain is set to the least-squares fit
`g = ⟨M(x) − D0, T(x)⟩ / ⟨T(x), T(x)⟩`, clamped to `[0, 1]` (no amplification of the trend; `T(x) = 0` keeps the
gain). Only then is the ladder advanced with `M(x)`. Before the first correction the gain is `damping`.

Why: on few-step samplers the step-to-step change is large and the trajectory curves, so a fixed damping tuned on 28–50
steps is wrong for some requests and right for others; the computed steps measure how far the trend carried. Exact on
linear sequences at any spacing from the 3rd computed step on (the fit gives `g = 1`), and one step ahead on geometric
increments `M(x0 + h) − M(x0) = q · (M(x0) − M(x0 − h))`, `q ≤ 1`, at equal spacing (`g = q`). With fewer than three
computed steps it is TaylorSeer with `damping`. The gain stays a 0-dim tensor (float32, float64 for float64
residuals; no host synchronisation).
Memory: TaylorSeer's `order + 1` residual-sized tensors.
"""

from __future__ import annotations

import torch

from .taylorseer import TaylorSeerCalibrator


class CorrectedTaylorCalibrator(TaylorSeerCalibrator):
    """TaylorSeer whose extrapolation gain is re-fitted from its own forecast error at every computed step."""

    def __init__(self, order: int = 1, damping: float = 1.0) -> None:
        super().__init__(order=order, damping=damping)
        self._gain: torch.Tensor | None = None  # None: no correction yet, use `damping`

    @property
    def gain(self) -> float:
        """The gain the next estimate uses (a host sync; for tests and inspection)."""
        return self.damping if self._gain is None else float(self._gain)

    def update(self, x: float, residual: torch.Tensor, source: torch.Tensor | None = None) -> None:
        if self._nodes and x == self._nodes[0]:
            self.reset()
        trend = self._trend(x)
        if trend is not None:
            acc = torch.promote_types(residual.dtype, torch.float32)  # float32 at least, float64 kept
            t = trend.to(acc)
            error = residual.to(acc) - self._ladder[0].to(acc)
            num, den = (error * t).sum(), (t * t).sum()
            fitted = torch.where(den > 0, num / den.clamp_min(torch.finfo(acc).tiny), self._gain_tensor(den))
            self._gain = fitted.clamp(0.0, 1.0)
        super().update(x, residual)

    def estimate(self, x: float, source: torch.Tensor | None = None) -> torch.Tensor:
        if not self._ladder:
            raise RuntimeError("CorrectedTaylorCalibrator.estimate called before any computed step")
        trend = self._trend(x)
        if trend is None:
            return self._ladder[0]
        if self._gain is None:
            return self._ladder[0] + trend * self.damping
        return self._ladder[0] + trend * self._gain.to(device=trend.device, dtype=trend.dtype)

    def _gain_tensor(self, like: torch.Tensor) -> torch.Tensor:
        if self._gain is None:
            return torch.tensor(self.damping, dtype=like.dtype, device=like.device)
        return self._gain.to(device=like.device, dtype=like.dtype)

    def reset(self) -> None:
        super().reset()
        self._gain = None
