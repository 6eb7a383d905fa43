"""Python bytecode kept in the compile-artifact store, so that a fresh process does not compile its modules' sources.

An installation without `.pyc` files (installed with `pip --no-compile`, or an image that strips them) whose processes
may not write them (`PYTHONDONTWRITEBYTECODE`, a read-only image) compiles every module's source on every start: about
2.5 s of a 30 s start-up of `dicache serve` on an H100 machine, by a sampling probe (`experiments/startup_probe`). The
first start that writes the start-up files' listing (`startup_files.record`) also has a subprocess compile the sources
of every module it imported into `STORE/bytecode-<digest>/` (the digest is the listing's: this installation), when
some of them had no bytecode, laid out as `sys.pycache_prefix` expects; a later start with that store (`use`, from the
command line's entry, before torch is imported) sets `sys.pycache_prefix` there, and the import system reads the
bytecode instead of compiling.

Contract:
- the `.pyc` files are hash-checked (`PycInvalidationMode.CHECKED_HASH`): a source that changed since is compiled
  again, never run from stale bytecode;
- a module the folder lacks is compiled from its source (what a process without `.pyc` files does anyway);
- the folder appears whole or not at all (written beside it, then renamed); writing never raises in the server:
  a failure is one log line, and the next start compiles its sources as before;
- nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import pathlib
import py_compile
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from . import startup_files

log = logging.getLogger("dicache.models.artifact_bytecode")

PREFIX = "bytecode-"


def folder(store: str | os.PathLike) -> pathlib.Path:
    """This installation's bytecode folder in `store`: `bytecode-<digest>`, the digest of the start-up files' listing
    (`startup_files.installation_digest`)."""
    return pathlib.Path(store) / f"{PREFIX}{startup_files.installation_digest()}"


def module_sources(modules: Iterable[Any] | None = None) -> tuple[list[str], int]:
    """The source file of every module of `modules` (default: every imported one) that has one (`.py`; extension
    modules and frozen ones excluded), and how many of them were imported without bytecode (their `__cached__` file
    does not exist: the import system compiled the source)."""
    found: dict[str, None] = {}
    compiled = 0
    for module in list(sys.modules.values()) if modules is None else modules:
        path = getattr(module, "__file__", None)
        if not (isinstance(path, str) and path.endswith(".py") and os.path.isfile(path)):
            continue
        path = os.path.abspath(path)
        if path not in found:
            found[path] = None
            cached = getattr(module, "__cached__", None)
            compiled += not (isinstance(cached, str) and os.path.isfile(cached))
    return list(found), compiled


def cache_path(prefix: str | os.PathLike, source: str) -> pathlib.Path:
    """Where the import system looks for `source`'s bytecode when `sys.pycache_prefix` is `prefix`."""
    saved = sys.pycache_prefix
    sys.pycache_prefix = str(prefix)
    try:
        return pathlib.Path(importlib.util.cache_from_source(source))
    finally:
        sys.pycache_prefix = saved


def write(target: str | os.PathLike, sources: Iterable[str]) -> dict[str, Any]:
    """Compile `sources` into `target` (a `sys.pycache_prefix` tree), atomically: into a sibling first, renamed when
    done; an existing one is kept. Returns {"status": "saved" | "kept", "files", "failed"} (a source that does not
    compile is left out: the import system compiles it, and reports its error, where it is imported)."""
    target = pathlib.Path(target)
    if target.is_dir():
        return {"status": "kept", "files": 0, "failed": 0}
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    written = failed = 0
    try:
        for source in sources:
            staged = staging / cache_path(target, source).relative_to(target)
            try:
                py_compile.compile(
                    source,
                    cfile=str(staged),
                    dfile=source,
                    doraise=True,
                    invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH,
                )
                written += 1
            except (py_compile.PyCompileError, OSError, ValueError):
                failed += 1
        staging.mkdir(parents=True, exist_ok=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"status": "saved", "files": written, "failed": failed}


def write_in_background(store: str | os.PathLike, modules: Iterable[Any] | None = None) -> subprocess.Popen | None:
    """Start a subprocess that writes the bytecode of `modules`' sources (default: every imported module) into
    `folder(store)` (`write`), when this process compiled some of them from their sources (an installation with its
    `.pyc` files needs none) and the folder is not there. The server goes on serving meanwhile (another core, not this
    process's interpreter). Returns the process (None when nothing was started: no source compiled, the folder is
    there, or another process is writing it); never raises: a failure to start it is one log line."""
    target = folder(store)
    if target.is_dir() or _writer_running(target):
        return None
    paths, compiled = module_sources(modules)
    if not compiled:
        return None
    sources = target.with_name(f".{target.name}.sources.{os.getpid()}.json")
    try:
        sources.write_text(json.dumps(paths))
        command = [sys.executable, "-m", "dicache.models.artifact_bytecode", str(target), str(sources)]
        writer = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        with contextlib.suppress(OSError):
            sources.unlink(missing_ok=True)
        log.warning("bytecode: cannot write %s (%s); later starts compile their modules' sources", target, exc)
        return None
    # reaped when it ends (no zombie left while the server runs); `wait` still works for a caller that waits for it
    threading.Thread(target=writer.wait, name="dicache-bytecode-reaper", daemon=True).start()
    return writer


WRITER_STALE_S = 600.0
"""A writer's sources file older than this is taken for one that died: another writer may start."""


def _writer_running(target: pathlib.Path) -> bool:
    """Whether another process is writing `target` (its sources file, which the writer removes when done, is there
    and recent)."""
    with contextlib.suppress(OSError):
        for marker in target.parent.glob(f".{target.name}.sources.*.json"):
            if time.time() - marker.stat().st_mtime < WRITER_STALE_S:
                return True
    return False


def use(store: str | os.PathLike | None) -> pathlib.Path | None:
    """Read bytecode from `folder(store)` (`sys.pycache_prefix`) when it is there; returns the folder, or None
    (nothing changed). Call before the modules it holds are imported."""
    target = folder(store) if store is not None else None
    if target is None or not target.is_dir():
        return None
    sys.pycache_prefix = str(target)
    return target


def prepare_imports(store: str | os.PathLike | None) -> None:
    """What a process does with its artifact store before it imports its command's modules (`dicache`'s command
    line, a Ray Serve replica before it loads its model): read their bytecode from the store (`use`) and answer
    `importlib.metadata.packages_distributions()` from the store's listing (`startup_files.use_known_distributions`).
    Nothing changes without a store, or for what the store lacks."""
    if store is None:
        return
    use(store)
    startup_files.use_known_distributions(store)


def files(store: str | os.PathLike | None) -> list[pathlib.Path]:
    """Every bytecode file of `folder(store)` (for the prefetch to read ahead); [] when there is none."""
    target = folder(store) if store is not None else None
    return sorted(target.rglob("*.pyc")) if target is not None and target.is_dir() else []


def main(argv: list[str]) -> int:
    """`python -m dicache.models.artifact_bytecode FOLDER SOURCES.json`: `write` (the subprocess of
    `write_in_background`, which removes SOURCES.json)."""
    target, sources = pathlib.Path(argv[0]), pathlib.Path(argv[1])
    try:
        result = write(target, json.loads(sources.read_text()))
    except (OSError, ValueError) as exc:
        print(f"bytecode: cannot write {target}: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(OSError):
            sources.unlink(missing_ok=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
