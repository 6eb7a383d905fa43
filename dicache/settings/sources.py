"""Where cache settings come from besides the code: the `SGLANG_CACHE_DIT_*` environment variables and a settings
profile (`SGLANG_CACHE_DIT_PROFILE=path`, the JSON `dicache calibrate` writes), read into raw values by request key.

Values are not validated here (`CacheConfig` does that, once); names are: an unknown variable under the prefix or an
unknown profile key is a `ConfigError` listing the valid ones. `EnvironmentSource` / `ProfileSource` are the same
readers as pydantic-settings sources, for a bare `CacheConfig()`; they read the process environment, or inside
`sources_reading(environ)` that mapping instead (`CacheConfig.from_env` gives them an empty one: it has read its own
environment and profile already, and `CacheConfig.merged` has every value).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic_settings import PydanticBaseSettingsSource

from ..errors import ConfigError
from .catalogue import ENV_PREFIX, PROFILE_ENV, Setting

_SOURCES_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("dicache_settings_sources_environ", default=None)


@contextlib.contextmanager
def sources_reading(environ: Mapping[str, str]) -> Iterator[None]:
    """Within the block, `EnvironmentSource` and `ProfileSource` read `environ` instead of the process environment
    (validating a `CacheConfig` runs them: pydantic calls a settings class's own `__init__`)."""
    token = _SOURCES_ENVIRON.set(environ)
    try:
        yield
    finally:
        _SOURCES_ENVIRON.reset(token)


def _sources_environ() -> Mapping[str, str]:
    environ = _SOURCES_ENVIRON.get()
    return os.environ if environ is None else environ


IGNORED_ENV_PREFIXES = (ENV_PREFIX + "SECONDARY_",)
"""SGLang defines these for a second transformer (Wan2.2's low-noise expert); Krea-2 has one transformer."""


def read_environment(env: Mapping[str, str], by_env: Mapping[str, Setting]) -> dict[str, str]:
    """The raw values of the `SGLANG_CACHE_DIT_*` variables in `env`, keyed by request key (`by_env`: the settings
    by environment variable name); any other name under the prefix (except the profile and SGLang's `SECONDARY_*`)
    is a `ConfigError` listing the valid names."""
    values: dict[str, str] = {}
    unknown = []
    for name, raw in env.items():
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper == PROFILE_ENV or upper.startswith(IGNORED_ENV_PREFIXES):
            continue
        known = by_env.get(upper)
        if known is None:
            unknown.append(name)
        else:
            values[known.key] = raw
    if unknown:
        valid = ", ".join(by_env)
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(sorted(unknown))}; the {ENV_PREFIX}* variables are: "
            f"{valid}, {PROFILE_ENV}"
        )
    return values


def load_profile(path: str | os.PathLike, keys: Mapping[str, Any]) -> dict[str, Any]:
    """Read a settings profile: a JSON object whose `settings` (or top level) maps request keys (those in `keys`) to
    values. A relative value of a path setting (`Setting.path`) is made relative to the profile's folder."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{PROFILE_ENV}={str(path)!r}: no such file (expected a JSON profile from dicache calibrate)")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{PROFILE_ENV}={str(path)!r}: not valid JSON ({exc})") from None
    settings = data.get("settings", data) if isinstance(data, dict) else None
    if not isinstance(settings, dict):
        raise ConfigError(f"{PROFILE_ENV}={str(path)!r}: expected a JSON object with a 'settings' object")
    unknown = sorted(set(settings) - set(keys))
    if unknown:
        raise ConfigError(f"{PROFILE_ENV}={str(path)!r}: unknown key(s) {unknown}; allowed keys: {', '.join(keys)}")
    return resolve_paths(settings, p.resolve().parent, keys)


def resolve_paths(settings: dict[str, Any], folder: Path, keys: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` with each relative value of a path setting (`Setting.path`) made relative to `folder`."""
    for key, value in settings.items():
        if getattr(keys.get(key), "path", False) and isinstance(value, str) and value and not Path(value).is_absolute():
            settings[key] = str(folder / value)
    return settings


class EnvironmentSource(PydanticBaseSettingsSource):
    """pydantic-settings source: the process environment, as `read_environment` says."""

    def __init__(self, settings_cls: Any, by_env: Mapping[str, Setting]) -> None:
        super().__init__(settings_cls)
        self.by_env = by_env

    def get_field_value(self, field, field_name):  # pragma: no cover - __call__ does the work
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return read_environment(_sources_environ(), self.by_env)


class ProfileSource(PydanticBaseSettingsSource):
    """pydantic-settings source: the profile named by `SGLANG_CACHE_DIT_PROFILE`, as `load_profile` says."""

    def __init__(self, settings_cls: Any, keys: Mapping[str, Any]) -> None:
        super().__init__(settings_cls)
        self.keys = keys

    def get_field_value(self, field, field_name):  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _sources_environ().get(PROFILE_ENV)
        return load_profile(path, self.keys) if path else {}
