"""Bytecode in the compile-artifact store (`dicache.models.artifact_bytecode`): written by one start, read by the next
instead of compiling sources, never stale, and read ahead by the prefetch."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import types

from dicache.models import artifact_bytecode, prefetch, startup_files

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A fresh interpreter that may not write bytecode (as an image without .pyc files and PYTHONDONTWRITEBYTECODE),
# takes the store's bytecode as `dicache` does at its entry, counts the sources it compiles and imports the package.
IMPORTER = """
import json, sys
import importlib.machinery as machinery
from dicache.models import artifact_bytecode
compiled = []
original = machinery.SourceFileLoader.source_to_code
def counting(self, data, path, *args, **kwargs):
    compiled.append(path)
    return original(self, data, path, *args, **kwargs)
machinery.SourceFileLoader.source_to_code = counting
used = artifact_bytecode.use(sys.argv[2])
sys.path.insert(0, sys.argv[1])
import pkg.a, pkg.b
print(json.dumps({"used": str(used) if used else None, "compiled": sorted(compiled), "value": pkg.b.VALUE}))
"""


def _package(root: pathlib.Path, value: int) -> list[str]:
    package = root / "pkg"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("A = [i * i for i in range(10)]\n")
    (package / "b.py").write_text(f"from pkg.a import A\nVALUE = {value} + len(A)\n")
    return [str(p) for p in sorted(package.glob("*.py"))]


def _import(code: pathlib.Path, store: pathlib.Path) -> dict:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    result = subprocess.run(
        [sys.executable, "-c", IMPORTER, str(code), str(store)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_a_start_with_the_stores_bytecode_compiles_no_source_and_a_changed_source_is_compiled_again(tmp_path):
    code, store = tmp_path / "code", tmp_path / "store"
    sources = _package(code, 1)
    folder = artifact_bytecode.folder(store)
    assert folder.parent == store and folder.name.startswith(artifact_bytecode.PREFIX)
    listing = startup_files.listing_path(store)
    assert folder.name.split("-")[-1] == listing.stem.split("-")[-1]  # the listing's installation digest

    without = _import(code, store)  # no bytecode yet: every module compiled from its source, nothing changed
    assert without["used"] is None and len(without["compiled"]) == 3 and without["value"] == 11

    assert artifact_bytecode.write(folder, sources) == {"status": "saved", "files": 3, "failed": 0}
    assert artifact_bytecode.write(folder, sources)["status"] == "kept"
    assert not list(store.glob(".*"))  # no staging folder left
    assert artifact_bytecode.files(store) == sorted(artifact_bytecode.cache_path(folder, s) for s in sources)

    with_bytecode = _import(code, store)
    assert with_bytecode == {"used": str(folder), "compiled": [], "value": 11}

    (code / "pkg" / "b.py").write_text("from pkg.a import A\nVALUE = 100 + len(A)\n")  # changed since it was written
    changed = _import(code, store)
    assert changed["compiled"] == [str(code / "pkg" / "b.py")] and changed["value"] == 110  # never stale bytecode


def test_a_source_that_does_not_compile_is_left_out(tmp_path):
    sources = _package(tmp_path / "code", 1)
    broken = tmp_path / "code" / "pkg" / "broken.py"
    broken.write_text("def (:\n")
    result = artifact_bytecode.write(tmp_path / "out", [*sources, str(broken)])
    assert result == {"status": "saved", "files": 3, "failed": 1}


def _module(name: str, source: str, cached: str | None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__, module.__cached__ = source, cached
    return module


def test_the_server_start_writes_it_in_a_subprocess_once_and_the_prefetch_reads_it(tmp_path):
    sources = _package(tmp_path / "code", 1)
    compiled = [_module(f"m{i}", s, str(tmp_path / "absent.pyc")) for i, s in enumerate(sources)]  # no bytecode
    with_bytecode = [_module("m", sources[0], __file__)]  # its `__cached__` file exists
    assert artifact_bytecode.module_sources(compiled) == (sources, 3)
    assert artifact_bytecode.module_sources(with_bytecode) == ([sources[0]], 0)

    store = tmp_path / "store"
    store.mkdir()
    assert artifact_bytecode.write_in_background(store, with_bytecode) is None  # nothing was compiled: not needed
    writer = artifact_bytecode.write_in_background(store, compiled)
    assert writer is not None
    assert artifact_bytecode.write_in_background(store, compiled) is None  # one writer at a time
    deadline = time.monotonic() + 300
    while writer.returncode is None and time.monotonic() < deadline:  # reaped with nobody calling wait or poll
        time.sleep(0.05)
    assert writer.returncode == 0 and writer.wait(timeout=1) == 0
    folder = artifact_bytecode.folder(store)
    written = artifact_bytecode.files(store)
    assert written == sorted(artifact_bytecode.cache_path(folder, s) for s in sources)
    assert not list(store.glob(".*"))  # its sources list removed when done
    assert artifact_bytecode.write_in_background(store, compiled) is None  # written once

    code, weights = prefetch._prefetch_parts(None, store)
    assert set(written) <= set(code) and weights == []


def test_an_unwritable_store_is_one_line_and_nothing_else(caplog):
    store = "/sys/dicache-bytecode"
    compiled = [_module("m", __file__, "/nonexistent/m.pyc")]
    with caplog.at_level("WARNING", "dicache.models.artifact_bytecode"):
        assert artifact_bytecode.write_in_background(store, compiled) is None
    (record,) = [r for r in caplog.records if r.name == "dicache.models.artifact_bytecode"]
    assert "cannot write" in record.getMessage()
    assert artifact_bytecode.use(store) is None and artifact_bytecode.files(store) == []


def test_the_command_lines_entry_takes_the_stores_bytecode_before_the_commands_import(tmp_path, monkeypatch):
    from dicache import cli

    store = tmp_path / "store"
    folder = artifact_bytecode.folder(store)
    folder.mkdir(parents=True)
    seen = []

    class Parser:  # stands for the subcommands' parser, which the entry builds after taking the bytecode
        def parse_args(self, argv):
            seen.append(sys.pycache_prefix)
            return type("Args", (), {"run": lambda self, args: 0})()

    monkeypatch.setattr(cli, "build_parser", Parser)
    monkeypatch.setattr(cli, "start_prefetch", lambda argv: None)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    cli.main(["serve", "--compile", "--compile-artifact", str(store)])
    monkeypatch.setattr(sys, "pycache_prefix", None)
    cli.main(["serve", "--compile-artifact", str(store)])  # without --compile no store is used: nothing changes
    assert seen == [str(folder), None]


def test_dicache_warmup_waits_for_the_writer_before_it_exits(capsys):
    """A Job's pod ends with `dicache warmup`: it waits for the bytecode's writer, and gives up after its timeout."""
    from dicache.commands.warmup import wait_for_bytecode

    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for_bytecode(quick)
    assert quick.returncode == 0 and "bytecode written" in capsys.readouterr().out
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        wait_for_bytecode(slow, timeout=0.2)
        assert slow.poll() is None and "not written within 0 s" in capsys.readouterr().out
    finally:
        slow.kill()
        slow.wait()
    wait_for_bytecode(None)
    assert capsys.readouterr().out == ""
