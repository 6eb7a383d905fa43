"""Settings profiles on the command line: the `--profile PATH` option and writing a profile file.

A profile is the JSON that `dicache calibrate` writes: ``{"settings": {request key: value, ...}, "calibration":
{...how it was chosen...}}``. `dicache.settings.sources` reads it (`load_profile`) as the layer between the built-in
defaults and the `SGLANG_CACHE_DIT_*` variables. This module adds what the commands need on top:

- `ProfileOption`: the `--profile PATH` option of `generate`, `serve` and `config`, declared once.
- `cache_config(profile)`: `CacheConfig.from_env()` with `profile` in place of `SGLANG_CACHE_DIT_PROFILE` (the
  option wins over the variable); a missing or invalid file is a `ConfigError` naming ``--profile`` and the path.
- `write_profile(path, settings, calibration)`: write a profile atomically, after checking that `load_profile` and
  `CacheConfig` accept it (a profile that could not be loaded is never written).
- `describe_profile(config)`: which profile values came from, those that differ from the defaults, and what it was
  calibrated for.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..formatting import show_value
from .cache_config import PROFILE_ENV, SETTINGS_BY_KEY, CacheConfig, load_profile
from .options import FlagOptions, option
from .sources import resolve_paths

OPTION = "--profile"


class ProfileOption(FlagOptions):
    """``--profile PATH`` (None: `SGLANG_CACHE_DIT_PROFILE` decides)."""

    profile: str | None = option(
        None,
        flag=OPTION,
        metavar="PATH",
        help=f"settings profile (JSON from `dicache calibrate`) under the SGLANG_CACHE_DIT_* variables; same as "
        f"{PROFILE_ENV}=PATH, and wins over it",
    )


def _option_error(path: str, exc: ConfigError) -> ConfigError:
    """`exc` re-worded to name the option: ``--profile 'PATH': <what is wrong>``."""
    message = str(exc)
    prefix = f"{PROFILE_ENV}={path!r}"
    if message.startswith(prefix):
        message = message[len(prefix) :].lstrip(": ")
    return ConfigError(f"{OPTION} {path!r}: {message}")


def check_profile(path: str | os.PathLike) -> dict[str, Any]:
    """The profile's `settings`, after checking that the file exists, parses and holds valid values on its own.

    Raises `ConfigError` naming ``--profile`` and the path."""
    text = str(path)
    try:
        settings = load_profile(text)
        CacheConfig.from_env({PROFILE_ENV: text})  # its values alone, before the environment is layered on
    except ConfigError as exc:
        raise _option_error(text, exc) from None
    return settings


def cache_config(profile: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> CacheConfig:
    """The effective settings of a command: defaults < profile < `SGLANG_CACHE_DIT_*` (of `environ`, default the
    process environment). `profile` (the ``--profile`` option) replaces `SGLANG_CACHE_DIT_PROFILE` when given."""
    env = dict(os.environ if environ is None else environ)
    if profile is not None:
        check_profile(profile)
        env[PROFILE_ENV] = str(profile)
    return CacheConfig.from_env(env)


def profile_source(config: CacheConfig) -> str | None:
    """The path of the profile `config` took values from, or None."""
    for origin in config.sources().values():
        if origin.startswith("profile "):
            return origin[len("profile ") :]
    return None


def describe_profile(config: CacheConfig) -> str | None:
    """One line: the profile's path, how many values came from it and those that differ from the built-in defaults,
    then (when the file has them) its calibration target, fidelity and compute; None when no value came from a
    profile."""
    path = profile_source(config)
    if path is None:
        return None
    defaults = CacheConfig.defaults()
    taken = [key for key, origin in config.sources().items() if origin == f"profile {path}"]
    changed = [f"{k}={show_value(getattr(config, k))}" for k in taken if getattr(config, k) != getattr(defaults, k)]
    line = f"profile {path}: {len(taken)} value(s); not the defaults: {', '.join(changed) or 'none'}"
    summary = _calibration_summary(path)
    return f"{line}\n  {summary}" if summary else line


def _calibration_summary(path: str) -> str | None:
    try:
        calibration = json.loads(Path(path).read_text()).get("calibration")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(calibration, Mapping):
        return None
    achieved = calibration.get("achieved") or {}
    try:
        return (
            f"calibrated {calibration.get('date', '?')}: PSNR >= {float(calibration['target_psnr_db']):g} dB "
            f"({calibration.get('criterion', 'min')} over {len(calibration.get('prompts', []))} prompts: "
            f"min {float(achieved['psnr_min_db']):.2f} dB, mean {float(achieved['psnr_mean_db']):.2f} dB) at compute "
            f"{float(achieved['compute_fraction']):.3f}; {calibration.get('steps')} steps, guidance "
            f"{calibration.get('guidance_scale')}, {calibration.get('width')}x{calibration.get('height')} px"
        )
    except (KeyError, TypeError, ValueError):
        return None


def write_profile(path: str | os.PathLike, settings: Mapping[str, Any], calibration: Mapping[str, Any]) -> Path:
    """Write ``{"settings": settings, "calibration": calibration}`` to `path` (parents created), atomically.

    The document is first written to a temporary file beside `path` and loaded back through `load_profile` and
    `CacheConfig`; if either rejects it, `ConfigError` is raised and `path` is left untouched."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    document = {"settings": dict(settings), "calibration": dict(calibration)}
    text = json.dumps(document, indent=2, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        loaded = load_profile(tmp)
        CacheConfig.from_env({PROFILE_ENV: tmp})
        if loaded != resolve_paths(dict(document["settings"]), target.resolve().parent, SETTINGS_BY_KEY):
            raise ConfigError(f"profile {str(target)!r}: the settings did not survive a JSON round trip")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@dataclass(frozen=True)
class Profile:
    """A settings profile in Python (what `dicache.calibrate` returns): `settings` (request keys) and `calibration`
    (how they were chosen). `dicache.enable(pipe, profile)` takes it (`config`: the settings over the built-in
    defaults, caching on); `save(path)` writes the file `--profile` / `SGLANG_CACHE_DIT_PROFILE` read."""

    settings: Mapping[str, Any]
    calibration: Mapping[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> CacheConfig:
        return CacheConfig.defaults().merged({**dict(self.settings), "enable_cache": True})

    def save(self, path: str | os.PathLike) -> Path:
        return write_profile(path, self.settings, self.calibration)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        """A profile file, checked as `--profile` checks it."""
        settings = check_profile(path)
        calibration = json.loads(Path(path).read_text()).get("calibration") or {}
        return cls(settings, calibration)
