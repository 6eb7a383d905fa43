"""Module-level lazy exports: a package names what it offers and imports each submodule only on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` resolving `name` from the submodule `exports[name]` (relative, e.g.
    `".app"`), imported on first access; any other name raises `AttributeError` as a plain module would."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
