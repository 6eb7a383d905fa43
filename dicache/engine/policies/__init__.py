"""Cache decision policies: pure logic on a branch's counters, the step index and (lazily) a residual diff."""

from __future__ import annotations

from .base import CachePolicy, Decision, StepContext
from .dbcache import DBCachePolicy
from .easycache import EasyCachePolicy
from .magcache import MagCachePolicy
from .segments import Segment, middle_segments
from .simple import AlwaysCache, NeverCache
from .step_mask import curved_mask, preset_mask, step_mask
from .teacache import TeaCachePolicy

__all__ = [
    "AlwaysCache",
    "CachePolicy",
    "DBCachePolicy",
    "Decision",
    "EasyCachePolicy",
    "MagCachePolicy",
    "NeverCache",
    "Segment",
    "StepContext",
    "TeaCachePolicy",
    "curved_mask",
    "make_policy",
    "middle_segments",
    "preset_mask",
    "step_mask",
]


def make_policy(config, num_steps: int | None) -> CachePolicy:
    """The policy a `CacheConfig` asks for, for a request of `num_steps` steps."""
    if config.policy == "never":
        return NeverCache()
    if config.policy == "always":
        return AlwaysCache()
    mask = step_mask(config, num_steps)
    if config.policy == "teacache":
        return TeaCachePolicy(config.max_warmup_steps, config.teacache_thresh, config.teacache_coefficients, mask)
    if config.policy == "magcache":
        return MagCachePolicy(
            config.max_warmup_steps,
            config.magcache_thresh,
            config.max_continuous_cached_steps,
            config.magcache_ratios or (),
            mask,
        )
    if config.policy == "easycache":
        return EasyCachePolicy(config.max_warmup_steps, config.easycache_thresh, mask)
    return DBCachePolicy(
        warmup=config.max_warmup_steps,
        threshold=config.residual_diff_threshold,
        max_continuous=config.max_continuous_cached_steps,
        max_cached=config.max_cached_steps,
        mask=mask,
        static_mask=config.scm_policy == "static",
    )
