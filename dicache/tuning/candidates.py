"""What `dicache calibrate` tries: the built-in candidates, a candidate file, and checking one candidate against a
model and schedule."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..engine.policies import make_policy
from ..errors import ConfigError
from ..settings.cache_config import CacheConfig
from ..sweep.files import read_data_file
from ..sweep.settings import RECOMMENDED_BUDGETS, recommended
from .errors import CalibrationError

CANDIDATES: tuple[dict[str, Any], ...] = (
    # Whole-step reuse on the curved mask (the recommendation), budget 0.3..0.8:
    # curve 2.5 up to 0.6, 1.5 above, 2.0 at 8 steps.
    *(recommended(f, 2.5) for f in RECOMMENDED_BUDGETS),
    *(recommended(f, 2.0) for f in (0.5, 0.6, 0.7)),
    *(recommended(f, 1.5) for f in (0.7, 0.8)),
    # ... with the forecasters that beat its TaylorSeer in some bins at 28 steps (issue 26, RESULTS.md): FoCa damped
    # 0.35 on curve 3.0 at 0.3, FoCa damped 0.5 at 0.7, DMD (history 4) at 0.7 and 0.8.
    {**recommended(0.3, 3.0), "forecaster": "foca", "taylorseer_damping": 0.35},
    {**recommended(0.3, 3.0), "taylorseer_damping": 0.35},
    {**recommended(0.7, 1.5), "forecaster": "foca"},
    *({**recommended(f, 1.5), "enable_taylorseer": False, "enable_dmd": True, "dmd_history": 4} for f in (0.7, 0.8)),
    # ... with a tenth of the tokens computed on the cached steps (cached_step_method=tokens; issue 43: it lost to
    # whole steps on the Turbo student, kept so that other models and schedules get measured; the native model only)
    *(
        {**recommended(f, c), "cached_step_method": "tokens", "cached_step_tokens": 0.1}
        for f, c in ((0.3, 3.0), (0.5, 2.0))
    ),
    # Dynamic DBCache: cache when the first blocks' residual barely moved (SGLang default: RDT 0.24, W 4, MC 3).
    {"residual_diff_threshold": 0.04},
    {"residual_diff_threshold": 0.08},
    {"residual_diff_threshold": 0.12},
    {"residual_diff_threshold": 0.16},
    {"residual_diff_threshold": 0.2},
    {"residual_diff_threshold": 0.24},
    {"residual_diff_threshold": 0.32},
    # ... with TaylorSeer extrapolating the skipped residual instead of reusing it.
    {"residual_diff_threshold": 0.08, "enable_taylorseer": True, "taylorseer_order": 1},
    {"residual_diff_threshold": 0.12, "enable_taylorseer": True, "taylorseer_order": 1},
    {"residual_diff_threshold": 0.24, "enable_taylorseer": True, "taylorseer_order": 1},
    {"residual_diff_threshold": 0.24, "enable_taylorseer": True, "taylorseer_order": 2},
    # ... with a longer warm-up and unlimited runs, or a deeper always-computed prefix.
    {
        "residual_diff_threshold": 0.08,
        "max_warmup_steps": 8,
        "max_continuous_cached_steps": -1,
        "enable_taylorseer": True,
        "taylorseer_order": 1,
    },
    {"residual_diff_threshold": 0.24, "Fn_compute_blocks": 2},
    {
        "residual_diff_threshold": 0.12,
        "Fn_compute_blocks": 4,
        "max_continuous_cached_steps": 4,
        "enable_taylorseer": True,
        "taylorseer_order": 1,
    },
    # Static step computation masks (the mask alone decides: warm-up 0), TaylorSeer off and on.
    {"scm_preset": "slow", "scm_policy": "static", "max_warmup_steps": 0},
    {"scm_preset": "slow", "scm_policy": "static", "max_warmup_steps": 0, "enable_taylorseer": True},
    {"scm_preset": "medium", "scm_policy": "static", "max_warmup_steps": 0},
    {"scm_preset": "medium", "scm_policy": "static", "max_warmup_steps": 0, "enable_taylorseer": True},
    {"scm_preset": "fast", "scm_policy": "static", "max_warmup_steps": 0},
    {"scm_preset": "fast", "scm_policy": "static", "max_warmup_steps": 0, "enable_taylorseer": True},
    {"scm_preset": "ultra", "scm_policy": "static", "max_warmup_steps": 0},
    {"scm_preset": "ultra", "scm_policy": "static", "max_warmup_steps": 0, "enable_taylorseer": True},
)
"""The built-in candidates `dicache calibrate` tries (without `--candidates FILE`): per-request override dicts,
each merged over the built-in defaults. Extend it with any `CacheConfig` request key; order does not matter."""


def load_candidates(path: str | Path) -> list[Any]:
    """The candidate list of a JSON or YAML (.yaml/.yml) file: a list of override dicts, or a mapping whose
    `candidates` is one. Entries are not checked here (a bad entry is reported and skipped by `calibrate`)."""
    data = read_data_file(
        path, "--candidates", CalibrationError, missing=": no such file (expected a JSON/YAML list of dicts)"
    )
    if isinstance(data, Mapping) and "candidates" in data:
        data = data["candidates"]
    if not isinstance(data, list) or not data:
        raise CalibrationError(
            f"--candidates {str(path)!r}: expected a non-empty list of override dicts "
            '(e.g. [{"residual_diff_threshold": 0.12}]), got ' + type(data).__name__
        )
    return data


def check_candidate(overrides: Any, num_blocks: int, steps: int, base: CacheConfig | None = None) -> CacheConfig:
    """The candidate's effective config (caching on, `overrides` over `base`, default the built-in defaults), after
    checking it against a model of `num_blocks` blocks at `steps` steps; `ConfigError` names what is wrong."""
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"a candidate must be a dict of override keys, got {overrides!r}")
    config = (base or CacheConfig.defaults()).merged({**dict(overrides), "enable_cache": True})
    config.check_block_split(num_blocks)
    make_policy(config, steps)  # a step mask must fit the step count
    return config
