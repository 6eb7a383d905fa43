"""`CacheConfig`: the cache settings, each field declared once with its rules (`setting(...)`), validated.

Three layers, later ones win: built-in defaults (SGLang's), an optional settings profile
(`SGLANG_CACHE_DIT_PROFILE=path`, written by `dicache calibrate`), the environment variables, and per-request
overrides (a dict keyed by the cache-dit/SGLang request keys, e.g. ``{"residual_diff_threshold": 0.12}``).
Every invalid value raises `ConfigError` naming the variable or key, the value and what is allowed.

The sources are read by `dicache.settings.sources`, the words come from `dicache.settings.catalogue`; `SETTINGS`, the
table every other view of the settings is derived from, is `catalogue(CacheConfig)`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..errors import BlockSplitError
from ..formatting import clip_repr
from .catalogue import ENV_PREFIX, PROFILE_ENV, Setting, catalogue, check_keys, config_error, describe_config
from .sources import EnvironmentSource, ProfileSource, read_environment, sources_reading
from .sources import load_profile as read_profile

__all__ = [
    "ENV_PREFIX",
    "MAX_SCM_BIN",
    "MAX_SCM_BINS",
    "PROFILE_ENV",
    "SETTINGS",
    "SETTINGS_BY_ENV",
    "SETTINGS_BY_KEY",
    "SETTINGS_BY_SHORT",
    "CacheConfig",
    "Setting",
    "load_profile",
    "setting",
]

MAX_SCM_BIN = 10_000
"""Longest run in `scm_compute_bins` / `scm_cache_bins`, in steps (no schedule is that long)."""
MAX_SCM_BINS = 1_000
"""Most runs in `scm_compute_bins` / `scm_cache_bins`."""


StepBins = Annotated[
    Annotated[list[Annotated[int, Field(ge=1, le=MAX_SCM_BIN)]], Field(max_length=MAX_SCM_BINS)] | None, NoDecode
]
"""Runs of steps (`scm_compute_bins`, `scm_cache_bins`): a comma-separated or JSON list, each run 1..MAX_SCM_BIN."""


FloatList = Annotated[
    Annotated[list[Annotated[float, Field(allow_inf_nan=False)]], Field(min_length=1, max_length=MAX_SCM_BIN)] | None,
    NoDecode,
]
"""Coefficients (`teacache_coefficients`): a list or comma-separated text."""
RatioList = Annotated[
    Annotated[list[Annotated[float, Field(gt=0, allow_inf_nan=False)]], Field(min_length=1, max_length=MAX_SCM_BIN)]
    | None,
    NoDecode,
]
"""Positive numbers, one per step (`magcache_ratios`): a list or comma-separated text."""


def setting(
    default: Any,
    *,
    env: str,
    meaning: str,
    allowed: str | None = None,
    short: str | None = None,
    path: bool = False,
    **rules,
):
    """A `CacheConfig` field declared with everything said about it elsewhere: its environment suffix `env`
    (``SGLANG_CACHE_DIT_<env>``), the sweep's `short` name (default: `env`), what it means and, where the
    field's type and bounds do not say it well, the `allowed` values in words; `path`: a file path, read relative to
    the profile's folder when a profile holds it. `rules` are pydantic's (ge, le...)."""
    extra = {"env": env, "short": short or env, "allowed": allowed, "path": path}
    return Field(default, description=meaning, json_schema_extra=extra, **rules)


def _parse_bins(value: Any) -> Any:
    """'8,3,3' or '[8, 3, 3]' -> a list (items validated by the field); a malformed string is a ValueError."""
    if value is None or isinstance(value, list | tuple):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text == "" or text.lower() in ("none", "unset"):
            return None
        if text.startswith("["):
            try:  # a flat list of numbers needs no nesting: refuse deep nesting before json recurses into it
                if text.count("[") > 1:
                    raise ValueError("nested lists")
                parsed = json.loads(text)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"not a JSON list of integers ({exc})") from None
            return parsed
        return [part.strip() for part in text.split(",")]
    return value


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


class CacheConfig(BaseSettings):
    """Validated cache settings. Field names are the per-request override keys (cache-dit/SGLang spelling)."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=True, frozen=True)

    enable_cache: bool = setting(
        False,
        env="ENABLED",
        meaning="turn caching on in the CLI and the server (an explicit dicache.enable() always turns it on)",
    )
    Fn_compute_blocks: int = setting(
        1,
        env="FN",
        short="Fn",
        ge=0,
        allowed="an integer >= 1, or 0 with a static step mask (scm_policy=static)",
        meaning="first blocks always computed; their residual drives the decision (0: a cached step runs no block)",
    )
    Bn_compute_blocks: int = setting(
        0, env="BN", short="Bn", ge=0, meaning="last blocks always computed, also on cached steps"
    )
    cached_step_blocks: Annotated[list[Annotated[int, Field(ge=0)]] | None, NoDecode] = setting(
        None,
        env="CACHED_STEP_BLOCKS",
        allowed="comma-separated distinct block indices in [Fn, num_blocks - Bn), e.g. 4,5 (empty: none)",
        meaning="middle blocks a cached step still computes (finer compute than whole steps); each run of the other "
        "middle blocks adds its own stored (or extrapolated) residual",
    )
    cached_step_method: Literal["forecast", "fitted", "tokens"] = setting(
        "forecast",
        env="CACHED_STEP_METHOD",
        short="CSM",
        meaning="what a cached step computes: forecast (no middle block runs; the forecaster's estimate), fitted (no "
        "forward runs: the transformer's output is predicted linearly from the last computed calls' inputs and "
        "outputs and this call's input, with the weights FITTED_PREDICTOR holds; needs a static step mask, Fn=Bn=0), "
        "or tokens (the CACHED_STEP_TOKENS share of the tokens whose input changed most since the last computed step "
        "run through every middle block, attending to keys/values kept from that step; the rest are forecast)",
    )
    cached_step_tokens: float = setting(
        0.2,
        env="CACHED_STEP_TOKENS",
        gt=0.0,
        lt=1.0,
        meaning="cached_step_method=tokens: share of a call's tokens a cached step computes (a fixed count, so "
        "shapes stay static under torch.compile)",
    )
    fitted_predictor: str | None = setting(
        None,
        env="FITTED_PREDICTOR",
        path=True,
        allowed="a path to a predictor file written by dicache calibrate (relative paths in a profile are relative "
        "to the profile's folder), or empty",
        meaning="cached_step_method=fitted: the per-step weights of the output predictor (fitted by dicache calibrate "
        "on training prompts for one step mask)",
    )
    max_warmup_steps: int = setting(
        4, env="WARMUP", short="W", ge=0, meaning="steps 0..W-1 of every branch are always computed"
    )
    residual_diff_threshold: float = setting(
        0.24,
        env="RDT",
        ge=0.0,
        allow_inf_nan=False,
        meaning="cache a step iff mean|r - r_prev| / mean|r_prev| < RDT (0 disables dynamic caching)",
    )
    max_continuous_cached_steps: int = setting(
        3, env="MC", ge=-1, meaning="longest run of consecutive cached steps per branch (-1: unlimited)"
    )
    max_cached_steps: int = setting(
        -1, env="MAX_CACHED_STEPS", ge=-1, meaning="most cached steps per branch and request (-1: unlimited)"
    )
    enable_taylorseer: bool = setting(
        False, env="TAYLORSEER", meaning="extrapolate the skipped residual with TaylorSeer"
    )
    taylorseer_order: Literal[1, 2] = setting(1, env="TS_ORDER", short="TS", meaning="TaylorSeer order")
    taylorseer_distance: Literal["step", "sigma"] = setting(
        "step",
        env="TS_DISTANCE",
        meaning="TaylorSeer measures distance in step indices or in the scheduler's sigmas",
    )
    taylorseer_damping: float = setting(
        1.0,
        env="TS_DAMPING",
        ge=0.0,
        le=1.0,
        meaning="scale of TaylorSeer's extrapolation terms (1: plain TaylorSeer, 0: reuse)",
    )
    forecaster: Literal["taylor", "corrected", "input_corrected", "foca"] = setting(
        "taylor",
        env="FORECASTER",
        meaning="how TAYLORSEER=true forecasts: taylor (TaylorSeer, fixed TS_DAMPING), corrected (TaylorSeer whose "
        "gain is re-fitted from the forecast error at every computed step, starting at TS_DAMPING), input_corrected "
        "(corrected, plus a fitted coupling to the change of the skipped blocks' input) or foca (FoCa: "
        "recursive prediction with a trapezoidal corrector anchored at the last computed step, scaled by TS_DAMPING)",
    )
    enable_dmd: bool = setting(
        False,
        env="DMD",
        meaning="forecast the skipped residual with DMD (an exponential basis fitted to the last computed residuals; "
        "excludes TAYLORSEER; distance as TS_DISTANCE)",
    )
    dmd_history: int = setting(
        6, env="DMD_HISTORY", ge=2, le=64, meaning="DMD: computed residuals kept for the fit (the newest ones)"
    )
    dmd_rank: int = setting(
        0, env="DMD_RANK", ge=0, meaning="DMD: rank of the fit (0: every singular value above 1e-7 of the largest)"
    )
    dmd_ridge: float = setting(
        1e-8,
        env="DMD_RIDGE",
        ge=0.0,
        allow_inf_nan=False,
        meaning="DMD: added to the singular values it inverts (regularises a nearly singular fit)",
    )
    scm_preset: Literal["none", "slow", "medium", "fast", "ultra", "curved"] = setting(
        "none",
        env="SCM_PRESET",
        short="SCM",
        meaning="step computation mask preset (slow..ultra: defined for 28 steps, rescaled to any count >= 4; "
        "curved: SCM_COMPUTE_FRACTION of the steps, dense at high noise as SCM_CURVE says)",
    )
    scm_compute_fraction: float = setting(
        0.5,
        env="SCM_COMPUTE_FRACTION",
        gt=0.0,
        le=1.0,
        meaning="curved preset: share of the steps computed (first and last always)",
    )
    scm_curve: float = setting(
        2.5,
        env="SCM_CURVE",
        ge=1.0,
        allow_inf_nan=False,
        meaning="curved preset: computed step j of k sits at round((j/(k-1))^SCM_CURVE * (n-1)); 1 = evenly spread",
    )
    scm_compute_bins: StepBins = setting(
        None,
        env="SCM_COMPUTE_BINS",
        allowed=f"at most {MAX_SCM_BINS} integers in [1, {MAX_SCM_BIN}]: a list, or comma-separated text (8,3,3,2,1,1)",
        meaning="explicit mask: runs of computed steps, alternating with SCM_CACHE_BINS",
    )
    scm_cache_bins: StepBins = setting(
        None,
        env="SCM_CACHE_BINS",
        allowed=f"at most {MAX_SCM_BINS} integers in [1, {MAX_SCM_BIN}]: a list, or comma-separated text (1,2,2,2,3)",
        meaning="explicit mask: runs of cacheable steps, alternating with SCM_COMPUTE_BINS",
    )
    scm_policy: Literal["dynamic", "static"] = setting(
        "dynamic",
        env="SCM_POLICY",
        meaning="dynamic: the mask only forbids caching; static: cache wherever the mask says 0",
    )
    policy: Literal["dbcache", "teacache", "magcache", "easycache", "never", "always"] = setting(
        "dbcache",
        env="POLICY",
        meaning="decision policy: dbcache (the Fn residual's change vs RDT), teacache (accumulated rescaled change "
        "vs TEACACHE_THRESH), magcache (the calibrated magnitude profile vs MAGCACHE_THRESH, runs <= MC), easycache "
        "(runtime transformation rate vs EASYCACHE_THRESH); never/always exist for testing and measurement",
    )
    teacache_thresh: float = setting(
        0.25,
        env="TEACACHE_THRESH",
        ge=0.0,
        allow_inf_nan=False,
        meaning="policy=teacache: cache while the accumulated rescaled Fn-residual change stays below this",
    )
    teacache_coefficients: FloatList = setting(
        [1.0, 0.0],
        env="TEACACHE_COEFFICIENTS",
        allowed="1 to 8 finite numbers, highest degree first: a list, or comma-separated text (e.g. 1.3,-0.02)",
        meaning="policy=teacache: the rescale polynomial c[0]*x^(n-1) + ... + c[n-1] (fitted by dicache calibrate)",
    )
    magcache_thresh: float = setting(
        0.06,
        env="MAGCACHE_THRESH",
        ge=0.0,
        allow_inf_nan=False,
        meaning="policy=magcache: cache while the accumulated magnitude-ratio error stays at or below this",
    )
    magcache_ratios: RatioList = setting(
        None,
        env="MAGCACHE_RATIOS",
        allowed="positive finite numbers, one per step of the calibrated schedule (a list or comma-separated text)",
        meaning="policy=magcache: per-step residual magnitude ratios (fitted from one sample by dicache calibrate; "
        "resampled to other step counts)",
    )
    easycache_thresh: float = setting(
        0.1,
        env="EASYCACHE_THRESH",
        ge=0.0,
        allow_inf_nan=False,
        meaning="policy=easycache: cache while the accumulated predicted output change stays below this",
    )

    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        return (
            init_settings,
            EnvironmentSource(settings_cls, SETTINGS_BY_ENV),
            ProfileSource(settings_cls, SETTINGS_BY_KEY),
        )

    @field_validator(
        "scm_compute_bins",
        "scm_cache_bins",
        "cached_step_blocks",
        "teacache_coefficients",
        "magcache_ratios",
        mode="before",
    )
    @classmethod
    def _split_bins(cls, value: Any) -> Any:
        return _parse_bins(value)

    @field_validator("fitted_predictor", mode="before")
    @classmethod
    def _empty_path(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "none", "unset"):
            return None
        return value

    @field_validator(
        "scm_preset", "scm_policy", "policy", "taylorseer_distance", "forecaster", "cached_step_method", mode="before"
    )
    @classmethod
    def _lowercase_choice(cls, value: Any) -> Any:
        return _lower(value)

    @field_validator("taylorseer_order", mode="before")
    @classmethod
    def _order_as_int(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value)
        return value

    @model_validator(mode="after")
    def _check_mask_settings(self) -> CacheConfig:
        blocks = self.cached_step_blocks
        if blocks is not None and len(set(blocks)) != len(blocks):
            raise ValueError(f"cached_step_blocks={clip_repr(blocks)} lists a block more than once")
        compute, cache = self.scm_compute_bins, self.scm_cache_bins
        if (compute is None) != (cache is None):
            raise ValueError(
                f"scm_compute_bins and scm_cache_bins must be set together (got compute={compute}, cache={cache})"
            )
        if compute is not None and self.scm_preset != "none":
            raise ValueError(
                f"set either scm_preset ({self.scm_preset!r}) or scm_compute_bins/scm_cache_bins, not both"
            )
        if compute is not None and not len(cache) <= len(compute) <= len(cache) + 1:
            raise ValueError(
                "scm_compute_bins and scm_cache_bins alternate starting with compute, so compute has as many bins as "
                f"cache or one more (got {len(compute)} compute and {len(cache)} cache bins)"
            )
        if self.forecaster != "taylor" and not self.enable_taylorseer:
            raise ValueError(
                f"forecaster={self.forecaster!r} chooses how enable_taylorseer=true (SGLANG_CACHE_DIT_TAYLORSEER) "
                "forecasts: set it, or leave forecaster=taylor; without it the skipped residual is reused"
            )
        if self.enable_dmd and self.enable_taylorseer:
            raise ValueError(
                "enable_dmd=true (SGLANG_CACHE_DIT_DMD) and enable_taylorseer=true (SGLANG_CACHE_DIT_TAYLORSEER) are "
                "two forecasters of the same residual: set one of them"
            )
        self._check_policy_settings()
        self._check_cached_step_method()
        if self.Fn_compute_blocks == 0 and self.policy == "dbcache" and not self.decides_statically:
            raise ValueError(
                "Fn_compute_blocks=0 needs a static step mask (scm_preset or scm_compute_bins with "
                f"scm_policy='static'; got scm_preset={self.scm_preset!r}, scm_policy={self.scm_policy!r}): "
                "the dynamic decision measures the residual of the first Fn >= 1 blocks"
            )
        return self

    def _check_policy_settings(self) -> None:
        """The rules between `policy` and the settings it reads; each error names both settings."""
        policy = self.policy
        if policy in ("teacache", "magcache", "easycache") and self.decides_statically:
            raise ValueError(
                f"policy={policy!r} decides at run time; scm_policy='static' would let the step mask decide alone: "
                "use scm_policy='dynamic' (the mask then only forbids caching) or policy='dbcache'"
            )
        if policy == "teacache" and self.Fn_compute_blocks == 0:
            raise ValueError(
                "policy='teacache' measures the change of the first blocks' residual: it needs Fn_compute_blocks >= 1 "
                "(got Fn_compute_blocks=0)"
            )
        if policy == "magcache" and not self.magcache_ratios:
            raise ValueError(
                "policy='magcache' needs magcache_ratios (SGLANG_CACHE_DIT_MAGCACHE_RATIOS), the per-step magnitude "
                "profile: fit it with `dicache calibrate` (it is stored in the profile) or pass it"
            )
        if self.teacache_coefficients is None or len(self.teacache_coefficients) > 8:
            raise ValueError(
                f"teacache_coefficients={clip_repr(self.teacache_coefficients)} must hold 1 to 8 coefficients"
            )

    def _check_cached_step_method(self) -> None:
        """The rules of `cached_step_method` and the settings it reads; each error names both settings."""
        method = self.cached_step_method
        if self.fitted_predictor is not None and method != "fitted":
            raise ValueError(
                f"fitted_predictor={self.fitted_predictor!r} is read only by cached_step_method='fitted' (got "
                f"cached_step_method={method!r}): set that method, or leave fitted_predictor empty"
            )
        if method == "tokens" and self.cached_step_blocks:
            raise ValueError(
                "cached_step_method='tokens' runs the chosen tokens through every skipped block of one middle "
                f"segment: it needs no cached_step_blocks (got cached_step_blocks={self.cached_step_blocks})"
            )
        if method != "fitted":
            return
        if not self.decides_statically or self.policy != "dbcache":
            raise ValueError(
                "cached_step_method='fitted' predicts the cached steps of the step mask it was fitted for: it needs "
                "policy='dbcache' with a static step mask (scm_compute_bins/scm_cache_bins or scm_preset, "
                f"scm_policy='static'; got policy={self.policy!r}, scm_policy={self.scm_policy!r}, "
                f"scm_preset={self.scm_preset!r})"
            )
        if self.Fn_compute_blocks or self.Bn_compute_blocks or self.cached_step_blocks:
            raise ValueError(
                "cached_step_method='fitted' runs no block on a cached step: it needs Fn_compute_blocks=0, "
                f"Bn_compute_blocks=0 and no cached_step_blocks (got Fn_compute_blocks={self.Fn_compute_blocks}, "
                f"Bn_compute_blocks={self.Bn_compute_blocks}, cached_step_blocks={self.cached_step_blocks})"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CacheConfig:
        """Read the environment (or `environ`), then apply `overrides`; raise `ConfigError` on any bad value."""
        check_keys(overrides, SETTINGS_BY_KEY, "override")
        env = os.environ if environ is None else environ
        env_values = read_environment(env, SETTINGS_BY_ENV)
        profile_path = env.get(PROFILE_ENV)
        profile = load_profile(profile_path) if profile_path else {}
        try:  # the environment and profile were read once, above: the settings sources add nothing
            with sources_reading({}):
                config = cls.model_validate({**profile, **env_values, **overrides})
        except ValidationError as exc:
            raise config_error(exc, SETTINGS_BY_KEY, overrides, env_values, profile, profile_path) from None
        sources = {}
        for knob in SETTINGS:
            if knob.key in overrides:
                sources[knob.key] = "override"
            elif knob.key in env_values:
                sources[knob.key] = f"env {knob.env_name}"
            elif knob.key in profile:
                sources[knob.key] = f"profile {profile_path}"
            else:
                sources[knob.key] = "default"
        config._sources = sources
        return config

    @classmethod
    def defaults(cls) -> CacheConfig:
        """The built-in defaults, ignoring the environment."""
        return cls.from_env({})

    def merged(self, overrides: Mapping[str, Any] | None) -> CacheConfig:
        """A new config with per-request `overrides` (request keys) applied on top of this one."""
        if not overrides:
            return self
        check_keys(overrides, SETTINGS_BY_KEY, "override")
        data = {**self.model_dump(), **dict(overrides)}
        try:
            with sources_reading({}):  # every value is in `data`: no environment or profile read again
                config = type(self).model_validate(data)
        except ValidationError as exc:
            raise config_error(exc, SETTINGS_BY_KEY, overrides, {}, {}, None) from None
        config._sources = {**self._sources, **{k: "override" for k in overrides}}
        return config

    def sources(self) -> dict[str, str]:
        """Where each value came from: 'default', 'env NAME', 'profile PATH' or 'override'."""
        return {k.key: self._sources.get(k.key, "default") for k in SETTINGS}

    def describe(self) -> str:
        """A readable table of the effective settings and their origins (used by `dicache config`)."""
        return describe_config(self, SETTINGS)

    # ------------------------------------------------------------------ derived
    @property
    def has_step_mask(self) -> bool:
        return self.scm_preset != "none" or self.scm_compute_bins is not None

    @property
    def decides_statically(self) -> bool:
        """Every decision comes from the step mask (no residual diff is ever measured)."""
        return self.has_step_mask and self.scm_policy == "static"

    def check_block_split(self, num_blocks: int) -> None:
        """Raise `BlockSplitError` unless at least one middle block remains between Fn and Bn."""
        fn, bn = self.Fn_compute_blocks, self.Bn_compute_blocks
        if fn + bn >= num_blocks:
            raise BlockSplitError(
                f"Fn_compute_blocks={fn} + Bn_compute_blocks={bn} must be < the model's {num_blocks} blocks "
                f"(at least one middle block to cache); allowed: Fn >= 1 (0 with a static mask), Bn >= 0, "
                f"Fn + Bn <= {num_blocks - 1}"
            )
        blocks = self.cached_step_blocks or []
        outside = [b for b in blocks if not fn <= b < num_blocks - bn]
        if outside:
            raise BlockSplitError(
                f"cached_step_blocks={clip_repr(blocks)}: block(s) {clip_repr(outside)} are not middle blocks; "
                f"allowed: indices in [Fn, num_blocks - Bn) = [{fn}, {num_blocks - bn}) for this "
                f"{num_blocks}-block model"
            )
        if len(blocks) >= num_blocks - fn - bn:
            raise BlockSplitError(
                f"cached_step_blocks={clip_repr(blocks)} computes every middle block [{fn}, {num_blocks - bn}): "
                "nothing is left to cache; list fewer blocks"
            )


SETTINGS: tuple[Setting, ...] = catalogue(CacheConfig)
"""Every cache setting, in declaration order; the table of docs/settings.md, env.example, `dicache config`, error
messages and the sweep's short names are all derived from it."""
SETTINGS_BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}
SETTINGS_BY_ENV: dict[str, Setting] = {s.env_name: s for s in SETTINGS}
SETTINGS_BY_SHORT: dict[str, Setting] = {s.short: s for s in SETTINGS}


def load_profile(path: str | os.PathLike) -> dict[str, Any]:
    """Read a settings profile: a JSON object whose `settings` (or top level) maps request keys to values; an unknown
    key, a missing file or bad JSON is a `ConfigError` naming `SGLANG_CACHE_DIT_PROFILE` and the path."""
    return read_profile(path, SETTINGS_BY_KEY)
