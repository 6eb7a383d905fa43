"""Every import path the documentation names keeps working after the package's layout changes (docs/architecture.md
§1): the public API, `dicache.<module>.<name>` references and `module:attribute` import paths in the README, docs,
notebooks and deploy manifests, and the `from dicache... import ...` lines of their code."""

from __future__ import annotations

import importlib
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "notebooks").glob("*.ipynb")),
    *sorted((ROOT / "deploy").rglob("*.yaml")),
]

PUBLIC_API = ("enable", "disable", "stats", "request", "step", "is_enabled", "session_of", "CacheConfig")
"""The one-call API (issue #28 names it), importable from the package itself."""

REFERENCE = re.compile(r"\bdicache(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
FROM_IMPORT = re.compile(r"^\s*from (dicache(?:\.\w+)*) import ([\w, ]+)", re.MULTILINE)
NOT_PYTHON = (".json", ".png", ".md", ".yaml", ".txt")


def _text(path: pathlib.Path) -> str:
    if path.suffix == ".ipynb":
        return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])
    return path.read_text()


def documented_paths() -> list[str]:
    """`dicache.a.b` / `dicache.a:b` references and `from dicache.a import b, c` (as `dicache.a.b`, ...)."""
    found = set()
    for path in DOCUMENTS:
        text = _text(path)
        found |= {ref for ref in REFERENCE.findall(text) if not ref.endswith(NOT_PYTHON)}
        for module, names in FROM_IMPORT.findall(text):
            found |= {f"{module}.{name.strip()}" for name in names.split(",") if name.strip()}
    return sorted(found)


def resolve(path: str):
    """The object `path` names (`a.b:c` is `a.b.c`): attributes from the top package down, importing a submodule only
    where the parent does not have the name yet."""
    parts = path.replace(":", ".").split(".")
    target = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=1):
        if not hasattr(target, name):
            importlib.import_module(".".join(parts[: i + 1]))
        target = getattr(target, name)
    return target


def test_the_documents_name_paths():
    paths = documented_paths()
    assert {"dicache.enable", "dicache.adapters.DualStream", "dicache.server.ray_serve:app_builder"} <= set(paths)
    assert "dicache.sweep.analysis.pareto_front" in paths  # from the notebook's `from ... import ...`


@pytest.mark.parametrize("path", documented_paths())
def test_documented_path_resolves(path):
    if path.startswith("dicache.server"):
        pytest.importorskip("fastapi")  # the serve extra
    assert resolve(path) is not None


def test_public_api_and_dicache_adapters_after_a_bare_import_dicache():
    """In a fresh interpreter (no other module imported first): `import dicache`, then the names the README uses."""
    names = ", ".join(f"dicache.{name}" for name in PUBLIC_API)
    code = f"import dicache; print([{names}, dicache.adapters.DualStream, dicache.adapters.SingleStream])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    from dicache.adapters import DualStream
    from dicache.engine.adapters import DualStream as EngineDualStream

    assert DualStream is EngineDualStream
