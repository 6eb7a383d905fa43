"""The package's layers (docs/architecture.md §1), checked on the source: every `import` in `dicache/`, at module
level and inside functions, read with `ast` (no module is imported).

- every module belongs to one unit of `LAYERS`; an import never goes from a lower layer to a higher one;
- no import cycle between modules, nor between units;
- no module of `dicache/models/` imports the engine (or the API over it): model code has no cache logic;
- an import inside a function says why it waits: a comment on its line or on the line before it, unless it imports an
  optional third-party dependency (`OPTIONAL`), which names itself.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections import defaultdict
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dicache"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("dicache.errors", "dicache.formatting", "dicache._lazy"),
    ("dicache.settings", "dicache.quantization", "dicache.blocks"),
    (
        "dicache.engine.policies",
        "dicache.engine.calibrators",
        "dicache.engine.cached_step",
        "dicache.engine.stats",
        "dicache.engine.block_plan",
        "dicache.engine.reduction",
    ),
    ("dicache.engine.state",),
    ("dicache.engine.session",),
    ("dicache.engine.adapters",),
    ("dicache.engine.hooks",),
    ("dicache.engine.install", "dicache.engine"),
    ("dicache.api", "dicache.adapters", "dicache"),
    ("dicache.offload",),
    ("dicache.models",),
    ("dicache.parallel",),
    ("dicache.sweep",),
    ("dicache.tuning",),
    ("dicache.server",),
    ("dicache.server.ray", "dicache.server.ray_serve", "dicache.server.ray_proxy"),
    ("dicache.commands", "dicache.cli"),
)
"""Units of the package, lowest layer first. A unit is a module or a package (with everything under it, unless a
longer name in the table claims a part of it). A unit may import units of its own layer or of lower ones."""

OPTIONAL = {
    "fastapi": "serve",
    "starlette": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "pynvml": "serve",
    "ray": "ray",
    "matplotlib": "report",
    "yaml": "report",
    "pytorch_msssim": "report",
    "torchao": "fp8",
    "diffusers": "bench / test",
    "cache_dit": "bench",
}
"""Optional third-party dependencies (top-level module -> the extra that installs it): imported inside the function
that needs them, so that the package works without them."""


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported dicache module (the longest existing module name)
    lazy: bool  # inside a function or class body
    line: int


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dicache modules `node` imports: `from a.b import c` is module `a.b.c` if that exists, else `a.b`."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in MODULES else origin for a in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name:
            found.append(name)
    return found


def _body_statements(tree: ast.Module) -> set[int]:
    """ids of the import statements that run when the module is imported (module level, also under if / try)."""
    top: set[int] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top.add(id(node))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return top


def _imports() -> tuple[list[Import], list[tuple[str, int, str]]]:
    """Every dicache import, and every function-level import as (file, line, first imported name)."""
    found, lazy = [], []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        top = _body_statements(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            is_lazy = id(node) not in top
            if is_lazy:
                first = node.names[0].name if isinstance(node, ast.Import) else "." * node.level + (node.module or "")
                lazy.append((str(path.relative_to(ROOT)), node.lineno, first))
            for target in _targets(module, path.name == "__init__.py", node):
                if target != module:
                    found.append(Import(module, target, is_lazy, node.lineno))
    return found, lazy


IMPORTS, LAZY = _imports()


def unit_of(module: str) -> str:
    """The `LAYERS` unit that holds `module` (the longest unit name that is the module or a package above it)."""
    units = [u for layer in LAYERS for u in layer if module == u or module.startswith(u + ".")]
    if not units:
        raise LookupError(f"{module} is in no unit of LAYERS: add it to the table (and to docs/architecture.md §1)")
    return max(units, key=len)


LAYER_OF = {unit: index for index, layer in enumerate(LAYERS) for unit in layer}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            connect(v)
    return found


def test_the_walk_sees_the_package():
    """The walk finds the modules and their imports, module-level and lazy (else every other test passes vacuously)."""
    assert {"dicache", "dicache.api", "dicache.engine.hooks", "dicache.settings.cache_config"} <= set(MODULES)
    pairs = {(i.source, i.target) for i in IMPORTS}
    assert ("dicache.engine.hooks", "dicache.engine.session") in pairs
    assert any(i.lazy for i in IMPORTS) and any(not i.lazy for i in IMPORTS)


def test_every_module_is_in_a_unit_of_the_layer_table():
    missing = []
    for module in MODULES:
        try:
            unit_of(module)
        except LookupError as exc:
            missing.append(str(exc))
    assert not missing, "\n".join(missing)
    units = [u for layer in LAYERS for u in layer]
    assert len(units) == len(set(units)), "a unit is listed twice"
    assert all(u in MODULES for u in units), [u for u in units if u not in MODULES]


def upward(imports: list[Import]) -> list[str]:
    """The imports that go from a lower layer to a higher one, as readable lines."""
    return sorted(
        f"{i.source}:{i.line} imports {i.target}{' (inside a function)' if i.lazy else ''}: "
        f"layer {LAYER_OF[unit_of(i.source)]} -> {LAYER_OF[unit_of(i.target)]}"
        for i in imports
        if LAYER_OF[unit_of(i.target)] > LAYER_OF[unit_of(i.source)]
    )


def test_no_import_goes_up_a_layer():
    found = upward(IMPORTS)
    assert not found, "\n".join(found)


MODEL = "dicache.models"
ENGINE = ("dicache.engine", "dicache.api", "dicache.adapters", "dicache")
"""The engine and the public API over it (`dicache` itself resolves `enable`, `stats`, ... to `dicache.api`)."""


def engine_imports_of_models(imports: list[Import]) -> list[str]:
    """The imports by a module of `dicache/models/` of the engine or of the API over it, as readable lines."""
    return sorted(
        f"{i.source}:{i.line} imports {i.target}{' (inside a function)' if i.lazy else ''}"
        for i in imports
        if (i.source == MODEL or i.source.startswith(MODEL + "."))
        and (i.target in ENGINE or i.target.startswith("dicache.engine."))
    )


def test_no_model_module_imports_the_engine():
    """Model code has no cache logic: it reads its block stack from `dicache.blocks`, below the engine, and hands its
    memory glue to `dicache.offload`; it never imports the engine (docs/architecture.md §1)."""
    found = engine_imports_of_models(IMPORTS)
    assert not found, "\n".join(found)


def test_an_engine_import_of_a_model_is_found():
    assert engine_imports_of_models(
        [
            Import("dicache.models.krea2.memory", "dicache.engine.adapters", False, 16),
            Import("dicache.models.krea2.pipeline", "dicache", True, 9),
            Import("dicache.models.krea2.pipeline", "dicache.blocks", False, 3),
            Import("dicache.offload.layerwise", "dicache.engine.install", False, 27),
        ]
    ) == [
        "dicache.models.krea2.memory:16 imports dicache.engine.adapters",
        "dicache.models.krea2.pipeline:9 imports dicache (inside a function)",
    ]


def test_an_upward_import_is_found():
    """A lazy import of a higher layer counts as much as a module-level one; a lower or same layer is fine."""
    assert upward([Import("dicache.engine.policies.dbcache", "dicache.engine.hooks", True, 3)]) == [
        "dicache.engine.policies.dbcache:3 imports dicache.engine.hooks (inside a function): layer 2 -> 6"
    ]
    assert upward([Import("dicache.server.ray_serve", "dicache.commands.serve", False, 9)]) != []
    assert (
        upward([Import("dicache.api", "dicache.engine.hooks", False, 1), Import("dicache.api", "dicache", True, 2)])
        == []
    )


@pytest.mark.parametrize("level", ["module", "unit"])
def test_no_import_cycles(level):
    edges: dict[str, set[str]] = defaultdict(set)
    for i in IMPORTS:
        source, target = (i.source, i.target) if level == "module" else (unit_of(i.source), unit_of(i.target))
        if source != target:
            edges[source].add(target)
    assert _cycles(edges) == []


def test_the_layer_table_is_the_one_in_the_architecture_document():
    """docs/architecture.md §1 lists the same units on the same layers (a package as `engine/policies/`, a module as
    `engine/stats.py`, a package whose parts are units of their own by its `__init__.py`: `engine/__init__.py`)."""

    def doc_name(unit: str) -> str:
        path = MODULES[unit].relative_to(ROOT if unit == "dicache" else PACKAGE)
        if path.name != "__init__.py" or any(other.startswith(unit + ".") for other in LAYER_OF):
            return path.as_posix()
        return f"{path.parent.as_posix()}/"

    documented: dict[str, int] = {}
    for row in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = row.split("|")
        if len(cells) > 3 and cells[1].strip().isdigit():
            for name in re.findall(r"`([^`]+)`", cells[2]):
                documented[name] = int(cells[1])
    assert documented == {doc_name(unit): layer for unit, layer in LAYER_OF.items()}


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_lazy_import_says_what_it_waits_for():
    """A function-level import carries a comment (on its line or the line above; a run of imports shares one), unless
    it imports an optional dependency, whose name says it."""
    silent = []
    for file, line, name in LAZY:
        if name.split(".")[0] in OPTIONAL:
            continue
        lines = (ROOT / file).read_text().splitlines()
        at = line - 1
        while at > 0 and "#" not in lines[at] and lines[at - 1].strip().startswith(("from ", "import ")):
            at -= 1  # a run of imports: the comment may sit above its first line
        if "#" in lines[at] or (at > 0 and lines[at - 1].strip().startswith("#")) or "#" in lines[at - 1]:
            continue
        silent.append(f"{file}:{line} ({name})")
    assert not silent, "function-level imports without a reason:\n" + "\n".join(silent)
