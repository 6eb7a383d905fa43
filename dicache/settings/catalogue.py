"""The cache settings as users meet them: `Setting` (request key, environment variable, sweep name, allowed values
and meaning), derived from a config model's field declarations (`catalogue`), and the words for a bad value.

Nothing here knows the fields themselves: `dicache.settings.cache_config` declares them (with `setting(...)`) and
derives its `SETTINGS` table with `catalogue(CacheConfig)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ..errors import ConfigError
from ..formatting import clip_repr, show_value
from .options import bounds as declared_bounds

ENV_PREFIX = "SGLANG_CACHE_DIT_"
PROFILE_ENV = ENV_PREFIX + "PROFILE"

CROSS_FIELD_KEYS = (
    "scm_",
    "Fn_compute_blocks",
    "Bn_compute_blocks",
    "policy",
    "forecaster",
    "enable_taylorseer",
    "cached_step_",
    "fitted_predictor",
)
"""Key prefixes a cross-field rule's message may come from: a bad combination names the values the user set among
these."""


@dataclass(frozen=True)
class Setting:
    """One cache setting as users meet it: request key (= field name), environment variable, sweep short name,
    allowed values and meaning. Derived from the field's declaration (`catalogue`)."""

    key: str
    env: str
    short: str
    allowed: str
    meaning: str
    path: bool = False
    """A file path: a profile's relative value is read relative to the profile's folder."""

    @property
    def env_name(self) -> str:
        return ENV_PREFIX + self.env


def catalogue(model: type[BaseModel]) -> tuple[Setting, ...]:
    """One `Setting` per field of `model`, in declaration order. Each field is declared with `json_schema_extra`
    holding `env`, `short` and `allowed` (None: said by the type and bounds) and a `description` (its meaning)."""
    return tuple(
        Setting(
            key=key,
            env=field.json_schema_extra["env"],
            short=field.json_schema_extra["short"],
            allowed=allowed_in_words(field),
            meaning=field.description,
            path=bool(field.json_schema_extra.get("path")),
        )
        for key, field in model.model_fields.items()
    )


def allowed_in_words(field: FieldInfo) -> str:
    """What a field accepts, in words, from its declaration: the explicit `allowed` text, else its type and bounds."""
    if field.json_schema_extra["allowed"]:
        return field.json_schema_extra["allowed"]
    if get_origin(field.annotation) is Literal:
        choices = get_args(field.annotation)
        if len(choices) > 3:
            return "one of " + ", ".join(str(v) for v in choices)
        return ", ".join(repr(v) for v in choices[:-1]) + f" or {choices[-1]!r}"
    if field.annotation is bool:
        return "a boolean (true/false, 1/0, yes/no, on/off)"
    bounds = {b: f"{value:g}" for b, value in declared_bounds(field).items()}
    noun = "an integer" if field.annotation is int else "a number"
    low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}" if "gt" in bounds else None
    if low is not None and "le" in bounds:
        return f"{noun} in {low}, {bounds['le']}]"
    if low is not None:
        return f"{noun} {'>=' if low[0] == '[' else '>'} {low[1:]}"
    return noun


def check_keys(overrides: Mapping[str, Any], by_key: Mapping[str, Setting], what: str) -> None:
    """Raise `ConfigError` naming the keys of `overrides` that are not settings (at most five shown) and the keys
    that are."""
    unknown = [k for k in overrides if k not in by_key]
    if unknown:
        shown = [clip_repr(k) for k in unknown[:5]] + ([f"and {len(unknown) - 5} more"] if len(unknown) > 5 else [])
        raise ConfigError(f"unknown cache {what} key(s) {', '.join(shown)}; allowed keys: {', '.join(by_key)}")


def config_error(
    exc: ValidationError,
    by_key: Mapping[str, Setting],
    overrides: Mapping[str, Any],
    env_values: Mapping[str, Any],
    profile: Mapping[str, Any],
    profile_path: str | None,
) -> ConfigError:
    """`exc` in users' words: per bad value, where it came from (override key, environment variable or profile), the
    value and what is allowed; a cross-field rule's message with the related values the user set."""
    messages = []
    for err in exc.errors():
        key = str(err["loc"][0]) if err["loc"] else None
        knob = by_key.get(key) if key else None
        if knob is None:  # a cross-field rule
            origins = [f"{k}={clip_repr(v)}" for k, v in overrides.items() if k.startswith(CROSS_FIELD_KEYS)]
            origins += [
                f"{by_key[k].env_name}={clip_repr(v)}" for k, v in env_values.items() if k.startswith(CROSS_FIELD_KEYS)
            ]
            detail = str(err["msg"]).removeprefix("Value error, ")
            messages.append(detail + (f" (from {', '.join(origins)})" if origins else ""))
            continue
        if key in overrides:
            origin, value = f"cache override key {key!r}", overrides[key]
        elif key in env_values:
            origin, value = knob.env_name, env_values[key]
        elif key in profile:
            origin, value = f"{key!r} in profile {profile_path}", profile[key]
        else:
            origin, value = key, err.get("input")
        messages.append(f"{origin}={clip_repr(value)} is invalid: must be {knob.allowed}")
    return ConfigError("; ".join(messages))


def describe_config(config: Any, settings: tuple[Setting, ...]) -> str:
    """Aligned columns for `dicache config`: key, environment variable, effective value and where it came from
    (`config.sources()`)."""
    rows = [("key", "env variable", "value", "from")]
    sources = config.sources()
    for s in settings:
        rows.append((s.key, s.env_name, show_value(getattr(config, s.key)), sources[s.key]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
