"""Every import path the documentation names keeps working after the package's layout changes (docs/architecture.md
§1): the public API, `dicache.<module>.<name>` references and `module:attribute` import paths in the README, docs,
notebooks and deploy manifests, and the `from dicache... import ...` lines of their code. And what the README and
docs/ tell a user to run or open is there: their command lines parse (`dicache`) or name scripts, files and options
that exist, the repository paths they name exist, their links lead to a file (and anchor)."""

from __future__ import annotations

import importlib
import json
import pathlib
import re
import subprocess
import sys

import pytest
from documented_commands import command_lines, links, problem_with_command, problem_with_link, repository_paths

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "notebooks").glob("*.ipynb")),
    *sorted((ROOT / "deploy").rglob("*.yaml")),
]

GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
"""The user's documents: what they say to run, open or follow must exist."""
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


def _commands() -> list[tuple[str, str]]:
    return [(path.name, command) for path in GUIDES for command in command_lines(path.read_text())]


def test_the_guides_hold_the_commands_ci_runs():
    commands = [command for _, command in _commands()]
    assert len(commands) > 40 and any(c.startswith("dicache serve") for c in commands)
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = 'pip install torch==2.13.0 -e ".[test]" && python -m pytest'
    assert test_command in ci and f"    {test_command}\n" in readme  # .ci/run runs the README's test command verbatim


@pytest.mark.parametrize(("document", "command"), _commands())
def test_documented_command_runs_as_written(document, command):
    assert problem_with_command(command) is None, f"{document}: {command}: {problem_with_command(command)}"


def test_documented_repository_paths_exist():
    missing = [(p.name, path) for p in GUIDES for path in repository_paths(p.read_text()) if not (ROOT / path).exists()]
    assert not missing


def test_documented_links_lead_somewhere():
    broken = [(p.name, problem_with_link(p, target)) for p in GUIDES for target in links(p.read_text())]
    assert not [(name, problem) for name, problem in broken if problem]


def test_a_renamed_flag_or_a_moved_script_is_caught():
    """The checks above can fail: each of these is what a stale document would say."""
    assert "refuses" in problem_with_command("dicache generate 'red apple' --no-such-flag")
    assert "does not exist" in problem_with_command("python benchmarks/no_such_benchmark.py --results x.md")
    assert "defines no --no-such-option" in problem_with_command("python benchmarks/bench_serving.py --no-such-option")
    assert problem_with_command("SGLANG_CACHE_DIT_FN=0 torchrun --nproc_per_node 2 -m dicache.cli generate x") is None
    assert problem_with_link(ROOT / "README.md", "benchmarks/RESULTS.md#no-such-claim") is not None
