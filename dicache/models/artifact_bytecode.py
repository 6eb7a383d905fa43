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
import time
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("dicache.models.artifact_bytecode")

PREFIX = "bytecode-"


def folder_for(listing: str | os.PathLike) -> pathlib.Path:
    """The bytecode folder beside a start-up files' listing (`startup_files.listing_path`): the same digest."""
    listing = pathlib.Path(listing)
    digest = listing.stem.rsplit("-", 1)[-1]
    return listing.parent / f"{PREFIX}{digest}"


def module_sources(modules: Iterable[Any] | None = None) -> tuple[list[str], int]:
    """The source file of every module of `modules` (default: every imported one) that has one (`.py`; extension
    modules and frozen ones excluded), and how many of them were imported without bytecode (their `__cached__` file
    does not exist: the import system compiled the source)."""
    found: dict[str, None] = {}
    compiled = 0
    for module in list(sys.modules.values()) if modules is None else modules:
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path.endswith(".py") and os.path.isfile(path) and path not in found:
            found[os.path.abspath(path)] = None
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


def write(folder: str | os.PathLike, sources: Iterable[str]) -> dict[str, Any]:
    """Compile `sources` into `folder` (a `sys.pycache_prefix` tree), atomically: into a sibling first, renamed when
    done; an existing folder is kept. Returns {"status": "saved" | "kept", "files", "failed"} (a source that does not
    compile is left out: the import system compiles it, and reports its error, where it is imported)."""
    folder = pathlib.Path(folder)
    if folder.is_dir():
        return {"status": "kept", "files": 0, "failed": 0}
    staging = folder.with_name(f".{folder.name}.{os.getpid()}")
    written = failed = 0
    try:
        for source in sources:
            target = cache_path(folder, source)
            staged = staging / target.relative_to(folder)
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
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"status": "saved", "files": written, "failed": failed}


def write_in_background(listing: str | os.PathLike, modules: Iterable[Any] | None = None) -> subprocess.Popen | None:
    """Start a subprocess that writes the bytecode of `modules`' sources (default: every imported module) beside
    `listing` (`write`), when this process compiled some of them from their sources (an installation with its
    `.pyc` files needs none) and the folder is not there. The server goes on serving meanwhile (another core, not this
    process's interpreter). Returns the process (None when nothing was started: no source compiled, the folder is
    there, or another process is writing it); never raises: a failure to start it is one log line."""
    folder = folder_for(listing)
    if folder.is_dir() or _writer_running(folder):
        return None
    paths, compiled = module_sources(modules)
    if not compiled:
        return None
    sources = folder.with_name(f".{folder.name}.sources.{os.getpid()}.json")
    try:
        sources.write_text(json.dumps(paths))
        command = [sys.executable, "-m", "dicache.models.artifact_bytecode", str(folder), str(sources)]
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        with contextlib.suppress(OSError):
            sources.unlink(missing_ok=True)
        log.warning("bytecode: cannot write %s (%s); later starts compile their modules' sources", folder, exc)
        return None


WRITER_STALE_S = 600.0
"""A writer's sources file older than this is taken for one that died: another writer may start."""


def _writer_running(folder: pathlib.Path) -> bool:
    """Whether another process is writing `folder` (its sources file, which the writer removes when done, is there
    and recent)."""
    with contextlib.suppress(OSError):
        for marker in folder.parent.glob(f".{folder.name}.sources.*.json"):
            if time.time() - marker.stat().st_mtime < WRITER_STALE_S:
                return True
    return False


def use(listing: str | os.PathLike | None) -> pathlib.Path | None:
    """Read bytecode from the folder beside `listing` (`sys.pycache_prefix`) when it is there; returns the folder, or
    None (nothing changed). Call before the modules it holds are imported."""
    if listing is None:
        return None
    folder = folder_for(listing)
    if not folder.is_dir():
        return None
    sys.pycache_prefix = str(folder)
    return folder


def files(listing: str | os.PathLike | None) -> list[pathlib.Path]:
    """Every bytecode file of the folder beside `listing` (for the prefetch to read ahead); [] when there is none."""
    if listing is None or not folder_for(listing).is_dir():
        return []
    return sorted(folder_for(listing).rglob("*.pyc"))


def main(argv: list[str]) -> int:
    """`python -m dicache.models.artifact_bytecode FOLDER SOURCES.json`: `write` (the subprocess of
    `write_in_background`, which removes SOURCES.json)."""
    folder, sources = pathlib.Path(argv[0]), pathlib.Path(argv[1])
    try:
        result = write(folder, json.loads(sources.read_text()))
    except (OSError, ValueError) as exc:
        print(f"bytecode: cannot write {folder}: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(OSError):
            sources.unlink(missing_ok=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
