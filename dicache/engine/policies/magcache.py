"""MagCache (Ma et al. 2025, arXiv 2506.09045): skip while the error predicted by a calibrated residual-magnitude
profile stays small.

`ratios[t]` is the mean, over tokens, of `‖r_t‖ / ‖r_{t−1}‖` for the stack's residual `r` at step `t`, measured once
on one sample (`dicache calibrate`, `tuning/fits.py`). Since the branch's last computed step the accumulated ratio is
the product of the ratios of the steps since, and the error the sum of `|1 − product|` over them; a step is cached
while that error is `<= threshold` and the run of cached steps stays `<= max_skip`. Everything follows from the step
index and `continuous_cached`, so the policy reads no tensor and needs no diff (no host synchronisation).
A profile of another step count is resampled to the request's by nearest index (as diffusers' MagCache does).
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Decision, DiffFn, StepContext, compute


def resample(ratios: Sequence[float], num_steps: int) -> list[float]:
    """`ratios` at `num_steps` entries by nearest index (the first and last entries kept)."""
    n = len(ratios)
    if num_steps == n or n == 0:
        return list(ratios)
    if num_steps == 1:
        return [ratios[-1]]
    return [ratios[round(i * (n - 1) / (num_steps - 1))] for i in range(num_steps)]


class MagCachePolicy:
    """Decide compute/cache for one branch's call from the magnitude-ratio profile.

    Args:
        warmup: steps `s < warmup` compute.
        threshold: largest accumulated error that still caches; `<= 0` never caches.
        max_skip: most consecutive cached steps (-1 unlimited).
        ratios: the calibrated profile, one entry per step of the calibrated schedule.
        mask: a step mask that only forbids caching, or None.
    """

    uses_diff = False  # the profile decides; no tensor is read

    def __init__(
        self,
        warmup: int,
        threshold: float,
        max_skip: int,
        ratios: Sequence[float],
        mask: list[int] | None = None,
    ) -> None:
        self.warmup, self.threshold, self.max_skip, self.mask = warmup, threshold, max_skip, mask
        self.ratios = tuple(ratios)

    def error(self, step: int, continuous_cached: int, num_steps: int | None) -> float:
        """The accumulated error of caching `step` after `continuous_cached` cached steps."""
        profile = resample(self.ratios, num_steps) if num_steps is not None else list(self.ratios)
        product, error = 1.0, 0.0
        for j in range(step - continuous_cached, step + 1):
            product *= profile[j] if j < len(profile) else 1.0
            error += abs(1.0 - product)
        return error

    def decide(self, ctx: StepContext, diff: DiffFn) -> Decision:
        s = ctx.step
        if s < self.warmup:
            return compute("warmup")
        if self.mask is not None and (s >= len(self.mask) or self.mask[s] == 1):
            return compute("mask")
        if self.threshold <= 0 or not self.ratios:
            return compute("threshold_off")
        if not ctx.has_residual:
            return compute("no_residual")
        if 0 <= self.max_skip <= ctx.continuous_cached:
            return compute("max_continuous")
        error = self.error(s, ctx.continuous_cached, ctx.num_steps)
        return Decision(cache=error <= self.threshold, reason="ratio", diff=error)
