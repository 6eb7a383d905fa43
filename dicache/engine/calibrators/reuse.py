"""Order 0: reuse the last computed middle residual as it is."""

from __future__ import annotations

import torch


class ReuseCalibrator:
    """Keeps the last computed residual and returns it unchanged (DBCache's plain reuse)."""

    def __init__(self) -> None:
        self._last: torch.Tensor | None = None

    def update(self, x: float, residual: torch.Tensor, source: torch.Tensor | None = None) -> None:
        self._last = residual

    def estimate(self, x: float, source: torch.Tensor | None = None) -> torch.Tensor:
        if self._last is None:
            raise RuntimeError("ReuseCalibrator.estimate called before any computed step")
        return self._last

    @property
    def ready(self) -> bool:
        return self._last is not None

    @property
    def stored_tensors(self) -> int:
        return 0 if self._last is None else 1

    def reset(self) -> None:
        self._last = None
