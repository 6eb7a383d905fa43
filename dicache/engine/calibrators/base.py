"""The calibrator contract: what to add on a cached step, given the middle residuals of computed steps."""

from __future__ import annotations

from typing import Protocol

import torch


class Calibrator(Protocol):
    """Pure tensor math on one residual stream of one branch.

    `update(x, residual, source)` is called on every computed step with the step's position `x` (step index or
    sigma), the middle residual `M` (any shape/dtype) and `source`, the stream entering the segment (None when the
    blocks do not take it). `estimate(x, source)` returns `M̂(x)` for a cached step at position `x` whose segment is
    entered by `source`. Only forecasters that model the input read `source`.
    A calibrator never changes the decision. `stored_tensors` counts the residual-sized tensors it holds.
    """

    def update(self, x: float, residual: torch.Tensor, source: torch.Tensor | None = None) -> None: ...

    def estimate(self, x: float, source: torch.Tensor | None = None) -> torch.Tensor: ...

    @property
    def ready(self) -> bool: ...

    @property
    def stored_tensors(self) -> int: ...

    def reset(self) -> None: ...
