"""Step computation masks (SCM): `1` = compute the step, `0` = the step may be cached.

Presets are defined for 28 steps as alternating runs (compute, cache, compute, …) and rescaled to any step
count >= 4 keeping the compute fraction and its placement; the first and last steps are always computed.
Explicit bins are used as given (truncated to the step count; too short is an error).
The `curved` preset computes a chosen share of the steps, placed densely where the noise is high: computed step j of k
sits at `round((j/(k−1))^γ·(n−1))` (γ = `scm_curve`; docs/architecture.md §8's static schedule is γ = 1.5).
"""

from __future__ import annotations

from ...errors import ConfigError
from ...formatting import clip_repr

PRESET_STEPS = 28
MIN_PRESET_STEPS = 4

# (compute runs, cache runs) over 28 steps. Same run structure as cache-dit's presets so that a server moving
# from SGLang keeps its meaning; compute fractions 18/28, 15/28, 11/28 and 8/28.
PRESET_BINS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "slow": ((8, 3, 3, 2, 1, 1), (1, 2, 2, 2, 3)),
    "medium": ((6, 2, 2, 2, 2, 1), (1, 3, 3, 3, 3)),
    "fast": ((6, 1, 1, 1, 1, 1), (1, 3, 4, 5, 4)),
    "ultra": ((4, 1, 1, 1, 1), (2, 5, 6, 7)),
}


def _runs(compute_bins, cache_bins) -> list[tuple[int, int]]:
    """Interleave bins into (value, length) runs: compute first."""
    runs = []
    for i, n in enumerate(compute_bins):
        runs.append((1, int(n)))
        if i < len(cache_bins):
            runs.append((0, int(cache_bins[i])))
    return runs


def mask_from_bins(compute_bins, cache_bins, num_steps: int) -> list[int]:
    """Expand explicit alternating bins into a mask of `num_steps` entries.

    Only the first `num_steps` entries are ever built, so memory and time are O(num_steps + bins) whatever the bin
    lengths."""
    mask: list[int] = []
    covered = 0
    for value, length in _runs(compute_bins, cache_bins):
        covered += length
        mask.extend([value] * min(length, num_steps - len(mask)))
    if covered < num_steps:
        raise ConfigError(
            f"scm_compute_bins={clip_repr(list(compute_bins))} + scm_cache_bins={clip_repr(list(cache_bins))} cover "
            f"{covered} steps; "
            f"the request has num_inference_steps={num_steps}, so the bins must cover at least that many"
        )
    return mask


def preset_mask(preset: str, num_steps: int) -> list[int]:
    """The preset's 28-step pattern rescaled to `num_steps` (>= 4), first and last steps computed.

    Each of the `num_steps` steps covers an equal slice of the 28-step pattern; the share of that slice the pattern
    computes is accumulated (error diffusion) and a step is computed whenever the running share reaches one half.
    This keeps both the compute fraction and where it is spent (dense at high noise).
    """
    if preset not in PRESET_BINS:
        raise ConfigError(f"scm_preset={preset!r} is invalid: must be one of none, {', '.join(PRESET_BINS)}")
    if num_steps < MIN_PRESET_STEPS:
        raise ConfigError(
            f"scm_preset={preset!r} needs num_inference_steps >= {MIN_PRESET_STEPS}; the request has {num_steps}"
        )
    pattern = [value for value, length in _runs(*PRESET_BINS[preset]) for _ in range(length)]

    def computed_before(x: float) -> float:  # computed steps of the 28-step pattern in [0, x)
        whole = int(x)
        partial = pattern[whole] * (x - whole) if whole < PRESET_STEPS else 0.0
        return sum(pattern[:whole]) + partial

    mask, carry = [], 0.0
    for i in range(num_steps):
        a, b = i * PRESET_STEPS / num_steps, (i + 1) * PRESET_STEPS / num_steps
        carry += (computed_before(b) - computed_before(a)) * num_steps / PRESET_STEPS
        take = carry >= 0.5 - 1e-9
        mask.append(1 if take else 0)
        carry -= 1.0 if take else 0.0
    mask[0] = 1
    mask[-1] = 1
    return mask


def curved_positions(num_steps: int, computed: int, curve: float) -> list[int]:
    """Exactly `computed` (clamped to [2, num_steps]) distinct step indices, dense at the start, 0 and n−1 included.

    Targets `round((j/(k−1))^curve·(n−1))`; where rounding makes two targets meet, the later one moves to the next free
    index so the count is exact.
    """
    n = num_steps
    k = max(min(int(computed), n), min(2, n))
    if k == n:
        return list(range(n))
    if k == 1:
        return [0]
    positions: list[int] = []
    for j in range(k):
        target = round((j / (k - 1)) ** curve * (n - 1))
        lowest = positions[-1] + 1 if positions else 0
        highest = n - (k - j)  # leave room for the remaining k − j − 1 positions
        positions.append(min(max(target, lowest), highest))
    return positions


def curved_mask(num_steps: int, fraction: float, curve: float) -> list[int]:
    """The `curved` preset: `round(fraction·n)` computed steps (at least the first and the last)."""
    if num_steps < 1:
        raise ConfigError(f"scm_preset='curved' needs num_inference_steps >= 1; the request has {num_steps}")
    chosen = set(curved_positions(num_steps, round(fraction * num_steps), curve))
    return [1 if i in chosen else 0 for i in range(num_steps)]


def step_mask(config, num_steps: int | None) -> list[int] | None:
    """The mask a `CacheConfig` asks for at `num_steps`, or None when it sets no mask."""
    if not config.has_step_mask:
        return None
    if num_steps is None:
        raise ConfigError(
            "a step mask (scm_preset / scm_compute_bins) needs the number of inference steps: call the pipeline, "
            "or wrap bare transformer calls in `with dicache.request(model, num_inference_steps=N):`"
        )
    if config.scm_compute_bins is not None:
        return mask_from_bins(config.scm_compute_bins, config.scm_cache_bins, num_steps)
    if config.scm_preset == "curved":
        return curved_mask(num_steps, config.scm_compute_fraction, config.scm_curve)
    return preset_mask(config.scm_preset, num_steps)
