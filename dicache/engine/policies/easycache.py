"""EasyCache (Zhou et al. 2025, arXiv 2507.02860): skip while the change predicted from the runtime transformation
rate stays under a threshold; no offline calibration.

On computed steps the engine measures the rate `k = mean|y − y'| / mean|x − x'|` between the branch's last two
computed calls (`x`: the stack's input streams, `y`: the middle's output; `StepContext.rate`). On the following calls
the policy reads `diff() = mean|x − x_prev| / mean|y_last|` (`signal = input_change`: the input's change since the
previous call, relative to the last computed output) and accumulates `k · diff`; the step is cached while the sum stays
strictly below the threshold, and a computed step resets it. The last step of a request always computes.
"""

from __future__ import annotations

from .base import Decision, DiffFn, StepContext, accumulator_gate, cache, compute


class EasyCachePolicy:
    """Decide compute/cache for one branch's call from the predicted output change.

    Args:
        warmup: steps `s < warmup` compute (at least two computed steps are needed for a rate).
        threshold: cache iff the accumulated predicted change stays `< threshold`; `<= 0` never caches.
        mask: a step mask that only forbids caching, or None.
    """

    signal = "input_change"

    def __init__(self, warmup: int, threshold: float, mask: list[int] | None = None) -> None:
        self.warmup, self.threshold, self.mask = warmup, threshold, mask

    @property
    def uses_diff(self) -> bool:
        return self.threshold > 0

    def decide(self, ctx: StepContext, diff: DiffFn) -> Decision:
        gate = accumulator_gate(ctx, self.warmup, self.mask, self.threshold)
        if gate is not None:
            return gate
        if not ctx.has_residual or ctx.rate is None:
            return compute("no_residual")
        value = diff()
        total = ctx.accumulated + ctx.rate * value
        if total < self.threshold:
            return cache("accumulated", value, accumulated=total)
        return compute("accumulated", value)
