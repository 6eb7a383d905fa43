"""dicache: step caching (DBCache + TaylorSeer) for Diffusion Transformer sampling.

import dicache
dicache.enable(pipe)            # our Krea2Pipeline, diffusers' Krea2Pipeline, or a bare transformer
image = pipe("a red apple").images[0]
print(dicache.stats(pipe))      # computed / cached steps per CFG branch

The API (`dicache.api`, which imports torch) and `CacheConfig` are imported on first use, so that importing a
light submodule, e.g. `dicache.server.ray.proxy` in Ray Serve's HTTP proxy, does not import torch or the engine.
Modules that moved keep their earlier paths (`MOVED_MODULES`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._lazy import alias_modules, lazy_getattr
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

MOVED_MODULES = {
    **{
        f"dicache.{name}": f"dicache.quantization.{name}"
        for name in ("fp8_storage", "hadamard", "fp8_emulation", "fp8_attention_emulation", "joint_linears")
    },
    **{
        f"dicache.engine.adapters.{name}": f"dicache.blocks.{name}"
        for name in ("forms", "stack", "families", "generic", "family_docs")
    },
}
"""Earlier module path -> the module's path now. Importing the earlier path gives the module itself, imported on
first use (`_lazy.alias_modules`): the 8-bit modules moved into `dicache/quantization/`, the block-stack description
out of the engine into `dicache/blocks/` (issue 44)."""

alias_modules(MOVED_MODULES)


def __getattr__(name: str):
    if name == "adapters":  # the documented `dicache.adapters.DualStream` after a bare `import dicache`
        return importlib.import_module(".adapters", __name__)
    return _exported(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
