"""Module-level lazy exports: a package names what it offers and imports each submodule only on first use; modules
keep their earlier import paths after a move (`alias_modules`)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
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


class ModuleAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Earlier module paths kept importable after a move: importing a key of `moved` (a full dotted name, e.g.
    `"dicache.hadamard"`) imports and returns the module its value names (`"dicache.quantization.hadamard"`), the same
    object, on first use. No file stays behind at the earlier path."""

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = dict(moved)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.moved else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder module, replaced by `exec_module`

    def exec_module(self, module: types.ModuleType) -> None:
        # the import system hands out what `sys.modules` holds once `exec_module` returns: the moved module itself
        sys.modules[module.__name__] = importlib.import_module(self.moved[module.__name__])


def alias_modules(moved: Mapping[str, str]) -> ModuleAliases:
    """Register `ModuleAliases(moved)` first on `sys.meta_path` (once: a second call with the same table returns the
    registered finder), so that the earlier paths win over a stale copy of the module elsewhere on the path."""
    for finder in sys.meta_path:
        if isinstance(finder, ModuleAliases) and finder.moved == dict(moved):
            return finder
    finder = ModuleAliases(moved)
    sys.meta_path.insert(0, finder)
    return finder
