"""The code files a start-up reads, listed by one start and read ahead by the next (`--prefetch-weights`).

Importing torch with CUDA, the server and transformers maps hundreds of MB of shared libraries and reads thousands
of compiled modules; on a node whose page cache is cold (a rescheduled pod) each first touch of a page waits on the
disk, a few pages at a time. A server started with `--compile` and a compile-artifact store writes, once its warm-up is
done, the list of what it used (`record`): every shared library mapped into the process (torch's, CUDA's, cuDNN's,
Triton's, the extension modules') and every module's compiled file, in `STORE/startup-files-<digest>.json`, the digest
naming this installation (the interpreter and every distribution in its site-packages with its version). The next
start's prefetch (`dicache.models.prefetch`) hands those files to the kernel's read-ahead before it reads the weights,
while the process is still importing.

A listing is written once (an existing one is kept; a read-only store is one log line); a listed file that no
longer exists is skipped (`listed_files`). Nothing here imports torch: the prefetch reads the listing before torch is
imported.

The listing also keeps `importlib.metadata.packages_distributions()` (which top-level package each distribution
installs), and `use_known_distributions` answers that call from it in later starts of the same installation:
transformers asks for it when imported, and computing it stats every file of every installed distribution (about
3.5 s on an H100 machine's cold disk, in the start-up's critical path, 2026-12-06).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import re
import struct
import sys
import sysconfig
import time
from typing import Any

log = logging.getLogger("dicache.models.startup_files")

PREFIX = "startup-files-"
MERGE_GAP = 1 << 18
"""Byte ranges of a library less than this apart (256 KiB) are read as one: the gap costs less than another read."""
_SHARED_LIBRARY = re.compile(r"\.so(\.[0-9.]+)?$")
_METADATA = (".dist-info", ".egg-info")


def installation_digest() -> str:
    """16 hex digits of a SHA-256 naming this installation: the interpreter (executable, version, prefix) and every
    installed distribution with its version (`installed_distributions`), so that another image or virtual
    environment, or an image that changed any package, has its own."""
    installation = [sys.executable, sys.version, sys.prefix, installed_distributions()]
    return hashlib.sha256(json.dumps(installation).encode()).hexdigest()[:16]


def listing_path(store: str | os.PathLike) -> pathlib.Path:
    """Where `store` keeps the listing of this installation's start-up files: `startup-files-<digest>.json`
    (`installation_digest`)."""
    return pathlib.Path(store) / f"{PREFIX}{installation_digest()}.json"


def installation_folders() -> list[str]:
    """The interpreter's own package folders (`sysconfig`'s purelib and platlib: the image's or the virtual
    environment's site-packages), the same in every process of one installation whatever its `sys.path` or working
    directory (a test runner's, a Ray worker's, `python -m` in a source checkout)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(paths[name] for name in ("purelib", "platlib")))


def installed_distributions() -> list[str]:
    """The distributions installed in `installation_folders()` as their metadata folders name them
    (`name-version.dist-info`, `.egg-info`), each folder's sorted: a listing of a folder or two, no metadata read, so
    that the prefetch can key the listing before torch is imported."""
    found: list[str] = []
    for folder in installation_folders():
        try:
            names = os.listdir(folder)
        except OSError:  # a folder gone
            continue
        found += sorted(name for name in names if name.endswith(_METADATA))
    return found


def mapped_libraries(maps: str | os.PathLike = "/proc/self/maps") -> list[str]:
    """The shared libraries (`*.so`, `*.so.N`) mapped into this process, each once, highest address first: Linux
    places each new mapping below the last, so this is about the order they were loaded in, which the next start's
    read-ahead follows. [] where `maps` cannot be read (not Linux)."""
    found: dict[str, int] = {}
    try:
        with open(maps) as fh:
            for line in fh:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/") and _SHARED_LIBRARY.search(path):
                    start = int(fields[0].split("-")[0], 16)
                    found[path] = min(start, found.get(path, start))
    except (OSError, ValueError):
        return []
    return sorted(found, key=found.__getitem__, reverse=True)


def touched_ranges(
    maps: str | os.PathLike = "/proc/self/maps", pagemap: str | os.PathLike = "/proc/self/pagemap"
) -> dict[str, list[list[int]]]:
    """For each shared library mapped into this process, the byte ranges `[offset, length]` of its file whose pages
    are in this process's memory (`pagemap`'s present bit: the pages it touched, with the kernel's fault-around),
    in file order, merged where less than `MERGE_GAP` apart. A start touches a fraction of its libraries (CUDA's and
    cuDNN's hold kernels for every GPU and case); reading only these leaves the disk to the rest. {} where either
    file cannot be read (not Linux)."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    pages: dict[str, set[int]] = {}
    try:
        with open(maps) as lines, open(pagemap, "rb", buffering=0) as entries:
            for line in lines:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if not (path.startswith("/") and _SHARED_LIBRARY.search(path)):
                    continue
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                first_page, offset = start // page, int(fields[2], 16) // page
                entries.seek(first_page * 8)
                present = pages.setdefault(path, set())
                for index, (entry,) in enumerate(struct.iter_unpack("<Q", entries.read((end - start) // page * 8))):
                    if entry >> 63:
                        present.add(offset + index)
    except (OSError, ValueError, struct.error):
        return {}
    return {path: _merged(sorted(found), page) for path, found in pages.items() if found}


def _merged(pages: list[int], page: int) -> list[list[int]]:
    """Sorted page numbers -> byte ranges `[offset, length]`, neighbours less than `MERGE_GAP` apart joined."""
    ranges: list[list[int]] = []
    for number in pages:
        offset = number * page
        if ranges and offset - (ranges[-1][0] + ranges[-1][1]) < MERGE_GAP:
            ranges[-1][1] = offset + page - ranges[-1][0]
        else:
            ranges.append([offset, page])
    return ranges


def module_files() -> list[str]:
    """Each imported module's file as the import system read it (the compiled `.pyc` where there is one, else the
    source or the extension module), in import order."""
    found: dict[str, None] = {}
    for module in list(sys.modules.values()):
        for name in ("__cached__", "__file__"):
            path = getattr(module, name, None)
            if isinstance(path, str) and os.path.isfile(path):
                found.setdefault(os.path.abspath(path))
                break
    return list(found)


def startup_files() -> list[str]:
    """What this process has read to start: its mapped shared libraries (the bulk of the bytes), then its modules'
    files."""
    libraries = mapped_libraries()
    mapped = set(libraries)
    return libraries + [path for path in module_files() if path not in mapped]


def record(store: str | os.PathLike) -> dict[str, Any]:
    """Write this process's start-up files (`startup_files`), with the byte ranges of its libraries it touched
    (`touched_ranges`: what the next start reads of them), to `listing_path(store)` unless a listing is there; never
    raises. Returns the outcome: {"status": "saved" | "kept" | "unwritable", "path", and for "saved" the "files" and
    the "GB" the next start reads} (one log line for "saved" and "unwritable")."""
    path = listing_path(store)
    if path.is_file():
        return {"status": "kept", "path": str(path)}
    files = startup_files()
    listed = set(files)
    ranges = {path: spans for path, spans in touched_ranges().items() if path in listed}
    sizes = {f: os.path.getsize(f) for f in files if os.path.isfile(f)}
    size = sum(sum(n for _, n in ranges[f]) if f in ranges else n for f, n in sizes.items())
    body = {"python": sys.version, "executable": sys.executable, "made": time.strftime("%Y-%m-%d %H:%M:%S")}
    body |= {"bytes": size, "file_bytes": sum(sizes.values()), "files": files, "ranges": ranges}
    body |= {"packages_distributions": _computing_packages_distributions()(), "sys_path": list(sys.path)}
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(body, indent=0))
        os.replace(temporary, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        log.warning("start-up files: cannot write %s (%s); the next start reads ahead only its weights", path, exc)
        return {"status": "unwritable", "path": str(path)}
    log.info("start-up files: %d (%.2f GB) listed in %s for the next start to read ahead", len(files), size / 1e9, path)
    return {"status": "saved", "path": str(path), "files": len(files), "GB": round(size / 1e9, 3)}


def _computing_packages_distributions() -> Any:
    """`importlib.metadata.packages_distributions` itself, the function that reads the installed distributions'
    metadata (the original behind `use_known_distributions`' replacement)."""
    answer = importlib.metadata.packages_distributions
    return getattr(answer, "computed", answer)


def use_known_distributions(store: str | os.PathLike | None) -> bool:
    """Answer `importlib.metadata.packages_distributions()` in this process from `store`'s listing for this
    installation (`listing_path`: its digest names every installed distribution and version), a fresh copy per
    call, while `sys.path` is the one the listing's answer was computed on (the call searches it; with another
    `sys.path` the call computes as before). Returns whether it was set (False, nothing changed: no store, no
    listing, or one without it). The original stays reachable as the replacement's `computed`."""
    if store is None:
        return False
    try:
        listing = json.loads(listing_path(store).read_text())
        known = {str(name): [str(d) for d in dists] for name, dists in listing["packages_distributions"].items()}
        searched = [str(entry) for entry in listing["sys_path"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    computed = _computing_packages_distributions()

    def packages_distributions() -> dict[str, list[str]]:
        if sys.path != searched:
            return computed()
        return {name: list(dists) for name, dists in known.items()}

    packages_distributions.computed = computed  # type: ignore[attr-defined]
    packages_distributions.__doc__ = computed.__doc__
    importlib.metadata.packages_distributions = packages_distributions
    return True


def listed_ranges(store: str | os.PathLike | None) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges `(offset, length)` of the listed libraries an earlier start touched (`touched_ranges`), by
    path; {} without a store, a listing, or ranges in it (a file not named is read whole)."""
    if store is None:
        return {}
    try:
        listed = json.loads(listing_path(store).read_text())["ranges"]
        return {str(path): [(int(offset), int(length)) for offset, length in spans] for path, spans in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def listed_files(store: str | os.PathLike | None) -> list[pathlib.Path]:
    """The files `store`'s listing for this Python names that exist here, in its order; [] without a store, a
    listing, or a readable one."""
    if store is None:
        return []
    try:
        listed = json.loads(listing_path(store).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [pathlib.Path(f) for f in listed if isinstance(f, str) and os.path.isfile(f)]
