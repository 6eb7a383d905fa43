"""`dicache.adapters`: the documented path of the block forms and adapters
(`dicache.enable(model, form=dicache.adapters.DualStream())`), which live in the engine, `dicache.engine.adapters`."""

from .engine import adapters as _engine_adapters
from .engine.adapters import *  # noqa: F403 - the engine package's own __all__, whatever it holds

__all__ = list(_engine_adapters.__all__)
