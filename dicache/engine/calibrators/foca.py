"""FoCa, forecast then calibrate (Zheng et al. 2025, arXiv 2508.16211): the skipped residual as the solution of an ODE,
advanced with a predictor and a trapezoidal (Heun) corrector anchored at the last computed residual.

State: the anchor `(xa, Ma)`, the last computed residual, with its slope `sa = (Ma − Mb) / (xa − xb)` over the previous
computed one, and a window of the two most recent values `(xk, Fk), (xk1, Fk1)`, computed or forecast. On a cached
step at `c` the local slope `sl = (Fk − Fk1) / (xk − xk1)` (after a computed step that followed cached ones it
compares the computed residual with the last forecast, which is the calibration) and the estimate is
`F(c) = Ma + damping · (c − xa) · (sa + sl) / 2`; `(c, F(c))` then enters the window, so the next cached step
predicts from it (recursive), while the anchor keeps it from drifting. Exact on linear sequences at any spacing
(both slopes equal the line's); with one computed step it reuses it. Positions are step indices or sigmas
(`taylorseer_distance`); an estimate asked twice at the same position returns the same tensor.
Memory: at most four residual-sized tensors (anchor, the previous computed one's slope, the window).
"""

from __future__ import annotations

import torch


class FoCaCalibrator:
    """Forecast then calibrate: recursive prediction corrected towards the last computed residual's trend."""

    def __init__(self, damping: float = 1.0) -> None:
        if not 0.0 <= damping <= 1.0:
            raise ValueError(f"taylorseer_damping={damping!r} is invalid: must be in [0, 1]")
        self.damping = damping
        self.reset()

    def update(self, x: float, residual: torch.Tensor, source: torch.Tensor | None = None) -> None:
        if self._anchor is not None and x == self._anchor[0]:
            self.reset()
        if self._anchor is not None:
            xa, ma = self._anchor
            self._slope = (residual - ma) / (x - xa)
        self._anchor = (x, residual)
        self._push(x, residual)

    def estimate(self, x: float, source: torch.Tensor | None = None) -> torch.Tensor:
        if self._anchor is None:
            raise RuntimeError("FoCaCalibrator.estimate called before any computed step")
        if self._window and x == self._window[0][0]:
            return self._window[0][1]
        xa, ma = self._anchor
        if self._slope is None or len(self._window) < 2:
            return ma
        (xk, fk), (xk1, fk1) = self._window
        local = (fk - fk1) / (xk - xk1)
        out = ma + (self._slope + local) * (self.damping * (x - xa) / 2)
        self._push(x, out)
        return out

    def _push(self, x: float, value: torch.Tensor) -> None:
        self._window = [(x, value), *self._window[:1]]

    @property
    def ready(self) -> bool:
        return self._anchor is not None

    @property
    def stored_tensors(self) -> int:
        held = {id(t) for t in [*(v for _, v in self._window), self._slope] if t is not None}
        if self._anchor is not None:
            held.add(id(self._anchor[1]))
        return len(held)

    def reset(self) -> None:
        self._anchor: tuple[float, torch.Tensor] | None = None
        self._slope: torch.Tensor | None = None
        self._window: list[tuple[float, torch.Tensor]] = []
