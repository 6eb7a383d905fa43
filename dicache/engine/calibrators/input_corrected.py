"""Input-corrected TaylorSeer: the corrected forecaster with a second regressor, the change of the segment's input.

Model: `M̂(c, u) = D0 + g · T(c) + a · (u − u0)`, with `D0`, `T` the Newton ladder of `CorrectedTaylorCalibrator`, `u`
the stream entering the skipped segment on the cached step and `u0` the one that entered it at the last computed step.
The skipped blocks map their input to their output; on a few-step sampler the input (the latent) moves a lot between
steps, and the part of the residual's change that follows the input is measured on the cached step itself, for free.

Fit: at every computed step `(x, u, M(x))`, the error of the reuse estimate `e = M(x) − D0` is regressed on
`t = T(x)` and `d = u − u0` by least squares (2 × 2 normal equations on the inner products); `g` is clamped to
`[0, 1]` (as in the corrected forecaster) and `a` re-fitted for the clamped `g`. Before a trend exists (2nd computed
step) only `a` is fitted. A stream whose input does not change between computed steps (`⟨d, d⟩ = 0`, e.g. a text
stream the blocks return but whose input stays fixed), or that is never handed an input, has no input regressor: it
is forecast exactly as `CorrectedTaylorCalibrator` forecasts it, never frozen. Collinear `t` and `d` (the 2 × 2
system singular to rounding) fall back the same way for that step.

Exact on residuals affine in the input (`M = A + K·u`, `K` a scalar) from the 2nd computed step on, whatever the
positions; exact where the corrected forecaster is exact when the input is still. Scalars stay 0-dim tensors (no host
synchronisation). Memory: the corrected forecaster's `order + 1` residual-sized tensors plus the input `u0`.
"""

from __future__ import annotations

import torch

from .corrected import CorrectedTaylorCalibrator
from .taylorseer import TaylorSeerCalibrator

COLLINEAR = 1e-6
"""The 2 × 2 fit is dropped when `det / (⟨t,t⟩⟨d,d⟩)` is below this (t and d nearly parallel)."""


class InputCorrectedCalibrator(CorrectedTaylorCalibrator):
    """`CorrectedTaylorCalibrator` plus a fitted coupling to the change of the segment's input."""

    def __init__(self, order: int = 1, damping: float = 1.0) -> None:
        super().__init__(order=order, damping=damping)
        self._source: torch.Tensor | None = None  # u0: the segment's input at the last computed step
        self._coupling: torch.Tensor | None = None  # a; None: no input regressor (still or input-less stream)

    @property
    def coupling(self) -> float | None:
        """The input coupling `a` the next estimate uses (0: still input), or None before any input was fitted (a host
        sync; for tests and inspection)."""
        return None if self._coupling is None else float(self._coupling)

    def update(self, x: float, residual: torch.Tensor, source: torch.Tensor | None = None) -> None:
        if self._nodes and x == self._nodes[0]:
            self.reset()
        acc = torch.promote_types(residual.dtype, torch.float32)
        if self._ladder:
            e = residual.to(acc) - self._ladder[0].to(acc)
            trend = self._trend(x)
            t = None if trend is None else trend.to(acc)
            d = None if source is None or self._source is None else source.to(acc) - self._source.to(acc)
            self._fit(e, t, d)
        TaylorSeerCalibrator.update(self, x, residual)
        self._source = source

    def _fit(self, e: torch.Tensor, t: torch.Tensor | None, d: torch.Tensor | None) -> None:
        tiny = torch.finfo(e.dtype).tiny
        if d is None:
            self._coupling = None
            if t is not None:
                self._gain = self._gain_only(e, t)
            return
        dd, ed = self._dot(d, d), self._dot(e, d)
        moved = dd > 0
        zero = torch.zeros((), dtype=e.dtype, device=e.device)
        if t is None:  # 2nd computed step: no trend yet, the input alone
            self._coupling = torch.where(moved, ed / dd.clamp_min(tiny), zero)
            return
        tt, td, et = self._dot(t, t), self._dot(t, d), self._dot(e, t)
        det = tt * dd - td * td
        solvable = (det > COLLINEAR * tt * dd) & moved
        gain_alone = self._gain_only(e, t)
        gain = torch.where(solvable, (et * dd - ed * td) / det.clamp_min(tiny), gain_alone).clamp(0.0, 1.0)
        self._gain = gain
        # `a` re-fitted for the clamped gain; a still input or a singular system gets 0: the corrected forecast
        self._coupling = torch.where(solvable, (ed - gain * td) / dd.clamp_min(tiny), zero)

    @staticmethod
    def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The inner product the fit uses (over every element)."""
        return (a * b).sum()

    def _gain_only(self, e: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The corrected forecaster's one-regressor gain, clamped to [0, 1]."""
        num, den = self._dot(e, t), self._dot(t, t)
        return torch.where(den > 0, num / den.clamp_min(torch.finfo(e.dtype).tiny), self._gain_tensor(den)).clamp(
            0.0, 1.0
        )

    def estimate(self, x: float, source: torch.Tensor | None = None) -> torch.Tensor:
        out = super().estimate(x)
        if self._coupling is None or source is None or self._source is None:
            return out
        return out + (source - self._source) * self._coupling.to(device=out.device, dtype=out.dtype)

    @property
    def stored_tensors(self) -> int:
        return len(self._ladder) + (self._source is not None)

    def reset(self) -> None:
        super().reset()
        self._source, self._coupling = None, None
