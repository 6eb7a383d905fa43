"""dicache: step caching (DBCache + TaylorSeer) for Diffusion Transformer sampling.

import dicache
dicache.enable(pipe)            # our Krea2Pipeline, diffusers' Krea2Pipeline, or a bare transformer
image = pipe("a red apple").images[0]
print(dicache.stats(pipe))      # computed / cached steps per CFG branch
"""

from .api import disable, enable, is_enabled, request, session_of, stats, step
from .config import CacheConfig
from .errors import BlockFormError, BlockSplitError, ConfigError, DicacheError, NotEnabledError, UnsupportedModelError
from .stats import BranchStats, RequestStats

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
