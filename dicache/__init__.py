"""dicache: step caching (DBCache + TaylorSeer) for Diffusion Transformer sampling.

import dicache
dicache.enable(pipe)            # our Krea2Pipeline, diffusers' Krea2Pipeline, or a bare transformer
image = pipe("a red apple").images[0]
print(dicache.stats(pipe))      # computed / cached steps per CFG branch
"""

from . import adapters  # noqa: F401 - the documented `dicache.adapters.DualStream` after a bare `import dicache`
from .api import disable, enable, is_enabled, request, session_of, stats, step
from .engine.stats import BranchStats, RequestStats
from .errors import BlockFormError, BlockSplitError, ConfigError, DicacheError, NotEnabledError, UnsupportedModelError
from .settings.cache_config import CacheConfig

__version__ = "0.1.0"

__all__ = [
    "BlockFormError",
    "BlockSplitError",
    "BranchStats",
    "CacheConfig",
    "ConfigError",
    "DicacheError",
    "NotEnabledError",
    "RequestStats",
    "UnsupportedModelError",
    "disable",
    "enable",
    "is_enabled",
    "request",
    "session_of",
    "stats",
    "step",
]
