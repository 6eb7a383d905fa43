"""dicache: step caching (DBCache + TaylorSeer) for Diffusion Transformer sampling.

import dicache
dicache.enable(pipe)            # our Krea2Pipeline, diffusers' Krea2Pipeline, or a bare transformer
image = pipe("a red apple").images[0]
print(dicache.stats(pipe))      # computed / cached steps per CFG branch

The API (`dicache.api`, which imports torch) and `CacheConfig` are imported on first use, so that importing a
light submodule, e.g. `dicache.server.ray.proxy` in Ray Serve's HTTP proxy, does not import torch or the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._lazy import lazy_getattr
from .engine.stats import BranchStats, RequestStats
from .errors import BlockFormError, BlockSplitError, ConfigError, DicacheError, NotEnabledError, UnsupportedModelError

if TYPE_CHECKING:  # for type checkers and IDEs; at run time `__getattr__` imports these on first use
    from .api import disable, enable, is_enabled, request, session_of, stats, step
    from .settings.cache_config import CacheConfig
    from .settings.profiles import Profile

__version__ = "0.1.0"

_EXPORTS = {
    **dict.fromkeys(("disable", "enable", "is_enabled", "request", "session_of", "stats", "step"), ".api"),
    "CacheConfig": ".settings.cache_config",
    "Profile": ".settings.profiles",
    "calibrate": ".tuning.api",
}

__all__ = [
    "BlockFormError",
    "BlockSplitError",
    "BranchStats",
    "CacheConfig",
    "ConfigError",
    "DicacheError",
    "NotEnabledError",
    "Profile",
    "RequestStats",
    "UnsupportedModelError",
    "calibrate",
    "disable",
    "enable",
    "is_enabled",
    "request",
    "session_of",
    "stats",
    "step",
]

_exported = lazy_getattr(__name__, _EXPORTS)


def __getattr__(name: str):
    if name == "adapters":  # the documented `dicache.adapters.DualStream` after a bare `import dicache`
        return importlib.import_module(".adapters", __name__)
    return _exported(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
