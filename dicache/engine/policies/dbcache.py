"""DBCache's dynamic decision (docs/architecture.md §2), with optional step masks. First rule that applies wins."""

from __future__ import annotations

from .base import Decision, DiffFn, StepContext, cache, compute


class DBCachePolicy:
    """Decide compute/cache for one branch's call.

    Args:
        warmup: W, steps `s < W` always compute.
        threshold: RDT, cache iff diff < RDT (strict); `<= 0` disables dynamic caching.
        max_continuous: MC, longest run of cached steps (-1 unlimited).
        max_cached: most cached steps per branch and request (-1 unlimited).
        mask: step computation mask (1 compute, 0 may cache) or None.
        static_mask: with a mask, cache wherever it says 0 (compute only if nothing is stored yet).
    """

    def __init__(
        self,
        warmup: int,
        threshold: float,
        max_continuous: int,
        max_cached: int = -1,
        mask: list[int] | None = None,
        static_mask: bool = False,
    ) -> None:
        self.warmup = warmup
        self.threshold = threshold
        self.max_continuous = max_continuous
        self.max_cached = max_cached
        self.mask = mask
        self.static_mask = static_mask

    @property
    def uses_diff(self) -> bool:
        """Whether any decision can measure a diff (else the Fn residual need not be stored)."""
        if self.threshold <= 0 or self.max_continuous == 0 or self.max_cached == 0:
            return False
        return not (self.mask is not None and self.static_mask)

    def decide(self, ctx: StepContext, diff: DiffFn) -> Decision:
        s = ctx.step
        if s < self.warmup:
            return compute("warmup")
        mask = self.mask
        if mask is not None:
            if s >= len(mask) or mask[s] == 1:
                return compute("mask")
            if self.static_mask:
                return cache("mask") if ctx.has_residual else compute("no_residual")
        if 0 <= self.max_cached <= ctx.cached_total:
            return compute("max_cached")
        if 0 <= self.max_continuous <= ctx.continuous_cached:
            return compute("max_continuous")
        if self.threshold <= 0:
            return compute("threshold_off")
        if not (ctx.has_reference and ctx.has_residual):
            return compute("no_residual")
        value = diff()
        return Decision(cache=value < self.threshold, reason="diff", diff=value)
