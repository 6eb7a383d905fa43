"""TeaCache (Liu et al. 2024, arXiv 2411.14324): skip while the accumulated, polynomially rescaled change of a cheap
timestep-aware indicator stays under a threshold.

The indicator here is the Fn residual (what the first `Fn >= 1` blocks add, a function of the timestep-modulated
input), compared with the previous call of the branch, computed or cached (`signal = fn_residual_consecutive`). Each
call adds `rescale(diff)` to the branch's accumulator; the step is cached while the sum stays strictly below the
threshold, and a computed step resets it. `rescale` (clamped at 0: a change never lowers the sum) is the polynomial
`c[0]·x^(n−1) + … + c[n−1]` (highest degree first, as SGLang's `coefficients`), fitted per model by `dicache
calibrate` (`tuning/fits.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Decision, DiffFn, StepContext, accumulator_gate, cache, compute


def polynomial(coefficients: Sequence[float], x: float) -> float:
    """`c[0]·x^(n−1) + … + c[n−1]` by Horner's rule (an empty list is 0)."""
    total = 0.0
    for c in coefficients:
        total = total * x + c
    return total


class TeaCachePolicy:
    """Decide compute/cache for one branch's call from the accumulated rescaled indicator change.

    Args:
        warmup: steps `s < warmup` compute (SGLang's `start_skipping`).
        threshold: cache iff the accumulated rescaled change stays `< threshold`; `<= 0` never caches.
        coefficients: the rescale polynomial, highest degree first.
        mask: a step mask (1 compute, 0 may cache) that only forbids caching, or None.
    The last step of a request always computes.
    """

    signal = "fn_residual_consecutive"

    def __init__(
        self, warmup: int, threshold: float, coefficients: Sequence[float], mask: list[int] | None = None
    ) -> None:
        self.warmup, self.threshold, self.coefficients, self.mask = warmup, threshold, tuple(coefficients), mask

    @property
    def uses_diff(self) -> bool:
        return self.threshold > 0

    def decide(self, ctx: StepContext, diff: DiffFn) -> Decision:
        gate = accumulator_gate(ctx, self.warmup, self.mask, self.threshold)
        if gate is not None:
            return gate
        if not (ctx.has_reference and ctx.has_residual):
            return compute("no_residual")
        value = diff()
        total = ctx.accumulated + max(polynomial(self.coefficients, value), 0.0)
        if total < self.threshold:
            return cache("accumulated", value, accumulated=total)
        return compute("accumulated", value)
