"""Names of cache settings as `sweep` and `calibrate` show and take them, derived from
`dicache.settings.cache_config.SETTINGS`.

One module for: the grid's short names (`ALIASES`, `GRID_KEYS`), the command-line grid axes (`grid_axes`), the two
label formats (`label`: environment suffixes, for candidates; `cell_label`: compact, for grid cells) and the
recommended settings family (`RECOMMENDED_FAMILY`).
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..formatting import show_value
from ..settings.cache_config import SETTINGS, SETTINGS_BY_KEY, CacheConfig

RECOMMENDED_FAMILY = {
    "Fn_compute_blocks": 0,
    "max_warmup_steps": 0,
    "scm_preset": "curved",
    "scm_policy": "static",
    "enable_taylorseer": True,
    "taylorseer_order": 1,
    "taylorseer_distance": "sigma",
    "taylorseer_damping": 0.5,
}
"""The recommended family (benchmarks/RESULTS.md#raw-vs-baselines): whole-step reuse on the curved mask with damped
TaylorSeer in sigma; `scm_compute_fraction` sets the budget, `scm_curve` where it is spent."""
RECOMMENDED_BUDGETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
"""The compute fractions the recommendation is measured at (and a sweep's report bins)."""


def recommended(fraction: float, curve: float | None = None) -> dict[str, Any]:
    """The recommended family's overrides at compute fraction `fraction`; `curve` None: 2.5 up to a budget of 0.6,
    1.5 above it (docs/settings.md, "Recommended settings")."""
    if curve is None:
        curve = 2.5 if fraction <= 0.6 else 1.5
    return {**RECOMMENDED_FAMILY, "scm_compute_fraction": fraction, "scm_curve": curve}


ALIASES = {s.short: s.key for s in SETTINGS if s.short != s.key and s.key != "enable_cache"}
"""Short names a grid may use for a key: each setting's declared short name (`Fn`, `W`, `RDT`, `TS`, `SCM`...)."""
GRID_KEYS = tuple(s.key for s in SETTINGS if s.key != "enable_cache")
"""Request keys a grid cell may set."""

AXIS_KEYS = (
    "Fn_compute_blocks",
    "Bn_compute_blocks",
    "max_warmup_steps",
    "residual_diff_threshold",
    "max_continuous_cached_steps",
    "taylorseer_order",
    "scm_preset",
    "scm_policy",
)
"""The settings `dicache sweep` takes as command-line grid axes (flag `--<short name>`)."""


def value_type(key: str) -> type:
    """The scalar type of a setting's values, read from its `CacheConfig` annotation (`Literal[1, 2]` -> int)."""
    annotation = CacheConfig.model_fields[key].annotation
    if typing.get_origin(annotation) is typing.Literal:
        return type(typing.get_args(annotation)[0])
    if isinstance(annotation, type):
        return annotation
    raise TypeError(f"setting {key!r} has no scalar type ({annotation!r})")


def grid_axes(keys: tuple[str, ...] = AXIS_KEYS) -> tuple[tuple[str, str, type], ...]:
    """(short name, request key, value type) of each axis key, in order."""
    return tuple((SETTINGS_BY_KEY[k].short, k, value_type(k)) for k in keys)


def label(overrides: Mapping[str, Any]) -> str:
    """A short name: the knobs' environment suffixes, e.g. ``RDT=0.24 TAYLORSEER=True``; `{}` is ``defaults``."""
    parts = []
    for key, value in overrides.items():
        known = SETTINGS_BY_KEY.get(key)
        parts.append(f"{known.env if known else key}={show_value(value)}")
    return " ".join(parts) or "defaults"


_LABELLED = {
    "enable_cache",
    "Fn_compute_blocks",
    "Bn_compute_blocks",
    "max_warmup_steps",
    "max_continuous_cached_steps",
    "residual_diff_threshold",
    "max_cached_steps",
    "scm_preset",
    "scm_compute_bins",
    "scm_cache_bins",
    "scm_policy",
    "scm_compute_fraction",
    "scm_curve",
    "enable_taylorseer",
    "taylorseer_order",
    "taylorseer_distance",
    "taylorseer_damping",
    "policy",
    "enable_dmd",
    "dmd_history",
    "dmd_rank",
    "dmd_ridge",
    "teacache_thresh",
    "teacache_coefficients",
    "magcache_thresh",
    "magcache_ratios",
    "easycache_thresh",
    "cached_step_method",
    "cached_step_tokens",
    "fitted_predictor",
}
"""Settings `cell_label` names in its compact parts; any other one is appended as `key=value` when not default."""

ALGORITHMS = ("recommended", "dbcache", "teacache", "magcache", "easycache", "foca", "dmd", "fitted", "tokens", "other")
"""The algorithm families a sweep's report compares (`algorithm`)."""


def algorithm(overrides: Mapping[str, Any] | None) -> str:
    """The family a cell belongs to: its cached-step method when it computes below step granularity (`fitted`,
    `tokens`), else its policy when it is TeaCache / MagCache / EasyCache, else its forecaster when
    it is FoCa or DMD, else `recommended` for `RECOMMENDED_FAMILY` (any budget, curve and damping, TaylorSeer plain or
    corrected), else `dbcache`; `other`
    for a cell that is not a valid config."""
    try:
        c = CacheConfig.defaults().merged(dict(overrides or {}))
    except ValueError:
        return "other"
    if c.cached_step_method in ("fitted", "tokens"):
        return c.cached_step_method
    if c.policy in ("teacache", "magcache", "easycache"):
        return c.policy
    if c.enable_dmd:
        return "dmd"
    if c.enable_taylorseer and c.forecaster == "foca":
        return "foca"
    family = c.model_dump()
    same = all(family[k] == v for k, v in RECOMMENDED_FAMILY.items() if k != "taylorseer_damping")
    if same and c.forecaster in ("taylor", "corrected"):
        return "recommended"  # any budget and curve; `corrected` is the Turbo recommendation (docs/settings.md)
    return "dbcache" if c.policy == "dbcache" else "other"


def cell_label(c: CacheConfig) -> str:
    """A compact name, e.g. `F1B0 W4 MC3 R0.24 TS1`, `F1B0 W4 SCM fast/static`, `F0B0 W0 SCM curved 0.4 γ1.5/static` or
    `F0B0 W0 SCM bins 3-1-1/1-1-1/static` (compute runs / cache runs);
    any other setting that differs from its default is appended as `key=value`."""
    parts = [f"F{c.Fn_compute_blocks}B{c.Bn_compute_blocks}", f"W{c.max_warmup_steps}"]
    static_mask = c.has_step_mask and c.scm_policy == "static"
    if c.policy == "teacache":
        parts.append(f"TeaCache {c.teacache_thresh:g}")
    elif c.policy == "magcache":
        parts += [f"MC{c.max_continuous_cached_steps}", f"MagCache {c.magcache_thresh:g}"]
    elif c.policy == "easycache":
        parts.append(f"EasyCache {c.easycache_thresh:g}")
    elif not static_mask:
        parts += [f"MC{c.max_continuous_cached_steps}", f"R{c.residual_diff_threshold:g}"]
    if c.max_cached_steps >= 0:
        parts.append(f"M{c.max_cached_steps}")
    if c.has_step_mask:
        if c.scm_preset == "curved":
            mask = f"curved {c.scm_compute_fraction:g} γ{c.scm_curve:g}"
        elif c.scm_preset != "none":
            mask = c.scm_preset
        else:
            compute, cache = ("-".join(map(str, b or [])) for b in (c.scm_compute_bins, c.scm_cache_bins))
            mask = f"bins {compute}/{cache}"
        parts.append(f"SCM {mask}/{c.scm_policy}")
    if c.enable_taylorseer:
        damping = c.taylorseer_damping
        parts.append(
            ("FoCa" if c.forecaster == "foca" else f"TS{c.taylorseer_order}")
            + ("σ" if c.taylorseer_distance == "sigma" else "")
            + (f" d{damping:g}" if damping < 1.0 else "")
        )
    if c.enable_dmd:
        parts.append(f"DMD{c.dmd_history}" + ("σ" if c.taylorseer_distance == "sigma" else ""))
    if c.cached_step_method == "fitted":
        parts.append("fitted" + (f" {Path(c.fitted_predictor).name}" if c.fitted_predictor else ""))
    elif c.cached_step_method == "tokens":
        parts.append(f"tokens {c.cached_step_tokens:g}")
    if c.policy not in ("dbcache", "teacache", "magcache", "easycache"):
        parts.append(f"policy {c.policy}")
    defaults = CacheConfig.defaults().model_dump()
    for key, value in c.model_dump().items():
        if key == "forecaster" and value == "foca":
            continue
        if key not in _LABELLED and value != defaults.get(key):
            parts.append(f"{key}={value}")
    return " ".join(parts)
