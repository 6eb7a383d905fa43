"""A checkpoint's files read into the page cache while the process is still importing, so that loading finds them
there (`--prefetch-weights`, on by default; docs/startup.md).

A start of `dicache serve` spends seconds importing (torch, CUDA, the server, transformers) before the first weight
is read; the disk is idle meanwhile. `start_prefetch` reads the files the load will read, in its order, on daemon
threads, from before the first heavy import: the loader then reads at memory speed what the prefetch already read,
and waits on the disk only for the rest. It imports nothing heavy (no torch), reads each file once, sequentially, in
large reads (the code files: the kernel's read-ahead, `Prefetch`), and keeps no data (the page cache holds it; the
kernel may drop it again under memory pressure, at no cost but the reread). It reads no more than half the memory
available at its start can hold (`available_memory`, the container's limit included), the load's first files first.

What is read (`files_to_prefetch`): first, with `--compile` and a compile-artifact store, the shared libraries and
compiled modules an earlier start listed there (`startup_files`: the code the imports read); then, for a local
checkpoint folder, in the load's order: the transformer's, the text encoder's and the VAE's weights (from the base
checkpoint named in `dicache.json` for a partial checkpoint); for the transformer and the text encoder, when the
artifact store holds quantised weights of this very component (a `weight_snapshot` manifest whose checkpoint
fingerprint matches), the newest such snapshot instead. A hub id, random weights (`--load-format dummy`) or a
missing folder read no weights.

`argv_request` finds the few options this needs in a command line before the command's parser exists (building it
imports torch); the flags are the declarations' (`PREFETCH_FLAGS`, checked against them by tests/test_prefetch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import artifact_bytecode, startup_files
from .store_layout import MANIFEST, PREFIX, artifact_store, checkpoint_fingerprint

CHUNK_BYTES = 16 << 20
THREADS = 4
COMMANDS = ("serve", "generate", "warmup")
"""The commands whose start reads a checkpoint the prefetch can know from its command line."""
COMPILING_COMMANDS = ("warmup",)
"""The commands that compile without `--compile` (`dicache warmup` sets it)."""
PREFETCH_FLAGS = {
    "model": "--model",
    "load_format": "--load-format",
    "compile": "--compile",
    "compile_artifact": "--compile-artifact",
    "prefetch_weights": "--prefetch-weights",
}
"""The declared flags (`models.options`) the prefetch reads, by field name."""
SNAPSHOT_COMPONENTS = ("transformer", "text_encoder")
"""The components whose quantised weights a store may hold (`weight_snapshot`)."""


def argv_request(argv: Sequence[str]) -> dict[str, Any] | None:
    """What a command line asks the prefetch for: {"model", "store"}, the model a local folder whose weights will be
    read (else None: a hub id, the embedded checkpoint, random weights) and the store `--compile-artifact`, else
    `DICACHE_COMPILE_ARTIFACT`, with `--compile` or for `dicache warmup` (else None); None when neither (or another
    command, or `--prefetch-weights false`). Never raises: the command's own parser reports a bad command line."""
    argv = list(argv)
    command = next((word for word in argv if not word.startswith("-")), None)
    if command not in COMMANDS or "--help" in argv or "-h" in argv:
        return None
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(PREFETCH_FLAGS["model"])
    parser.add_argument(PREFETCH_FLAGS["load_format"], default="auto")
    parser.add_argument(PREFETCH_FLAGS["compile"], action="store_true")
    parser.add_argument(PREFETCH_FLAGS["compile_artifact"])
    parser.add_argument(PREFETCH_FLAGS["prefetch_weights"], nargs="?", const="true", default="true")
    try:
        known, _ = parser.parse_known_args(argv)
    except SystemExit:  # a malformed flag: the command's parser says so
        return None
    if str(known.prefetch_weights).strip().lower() in ("false", "0", "no", "off"):
        return None
    model = os.path.expanduser(known.model) if known.model is not None else None
    if known.load_format != "auto" or model is None or not pathlib.Path(model).is_dir():
        model = None  # no weights to read; the store's start-up files still are
    store = artifact_store(known.compile_artifact) if known.compile or command in COMPILING_COMMANDS else None
    if model is None and store is None:
        return None
    return {"model": model, "store": None if store is None else str(store)}


MEMORY_SHARE = 0.5
"""The share of the memory available now (`available_memory`) that the prefetch may fill with page cache."""


def available_memory() -> int | None:
    """Bytes this process can still fill without pressing on memory: the kernel's `MemAvailable`, bounded by the
    cgroup's limit less its usage (a container's page cache is charged to it); None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as fh:
            found += [int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(pathlib.Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def within(files: list[pathlib.Path], budget: int | None) -> list[pathlib.Path]:
    """The first of `files` whose sizes add up to at most `budget` bytes (all of them when `budget` is None): a
    prefetch larger than the memory that can hold it would evict its own first pages before the load reads them."""
    if budget is None:
        return files
    chosen, total = [], 0
    for file in files:
        try:
            total += file.stat().st_size
        except OSError:
            continue
        if total > budget:
            break
        chosen.append(file)
    return chosen


def _safetensors_in(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def _snapshot_files(store: pathlib.Path | None, component: str, folder: pathlib.Path) -> list[pathlib.Path]:
    """The shards of the newest snapshot of `component` in `store` made from the checkpoint files in `folder`, or
    []."""
    if store is None or not store.is_dir():
        return []
    matching = []
    fingerprint = None
    for manifest in store.glob(f"{PREFIX}*/{MANIFEST}"):
        try:
            data = json.loads(manifest.read_text())
            key = data["key"]
            if fingerprint is None:
                fingerprint = json.dumps(checkpoint_fingerprint(folder), sort_keys=True)
            if key.get("component") == component and key.get("checkpoint") == fingerprint:
                matching.append((manifest.stat().st_mtime, manifest.parent, sorted(data.get("shards", {}))))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    if not matching:
        return []
    _, folder, shards = max(matching)
    return [folder / name for name in shards]


def files_to_prefetch(model: str | os.PathLike | None, store: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """The start-up files an earlier start listed in `store` (`startup_files.listed_files`), then the weight files
    a load of the local checkpoint `model` (if any) reads, in its order (module docstring)."""
    code, weights = _prefetch_parts(model, store)
    return code + weights


def _prefetch_parts(
    model: str | os.PathLike | None, store: str | os.PathLike | None
) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """`files_to_prefetch` in its two parts: the listed code files and the store's bytecode for them
    (`artifact_bytecode`), the weight files."""
    weights = checkpoint_weight_files(model, store) if model is not None else []
    bytecode = artifact_bytecode.files(store)
    return startup_files.listed_files(store) + bytecode, weights


def checkpoint_weight_files(model: str | os.PathLike, store: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """The weight files a load of the local checkpoint `model` reads, in its order (module docstring)."""
    root = pathlib.Path(model)
    base = root
    try:
        pointer = json.loads((root / "dicache.json").read_text()).get("base_checkpoint")
        if pointer and (root / pointer).is_dir():
            base = root / pointer
    except (OSError, ValueError, AttributeError):
        pass
    store = pathlib.Path(store) if store else None
    files: list[pathlib.Path] = []
    for name in ("transformer", "text_encoder", "vae"):  # the order the load reads them in
        folder = root / name if (root / name).is_dir() else base / name
        snapshot = _snapshot_files(store, name, folder) if name in SNAPSHOT_COMPONENTS else []
        files += snapshot or _safetensors_in(folder)
    return files


class Prefetch:
    """Reads `files` on up to `threads` daemon threads, each file whole and in order (see the module docstring).
    The first `read_ahead` of them (an earlier start's code files: thousands of files, mostly small) are not copied
    out but handed to the kernel's read-ahead (`POSIX_FADV_WILLNEED`: the kernel reads them into the page cache
    without a copy into this process), where it has one: each whole, or the byte ranges `(offset, length)` that
    `ranges` gives for its path (the parts of a library an earlier start touched)."""

    def __init__(
        self,
        files: Iterable[str | os.PathLike],
        threads: int = THREADS,
        read_ahead: int = 0,
        ranges: Mapping[str, Sequence[tuple[int, int]]] | None = None,
    ) -> None:
        self.files = [pathlib.Path(f) for f in files]
        self.read_ahead = read_ahead
        self.ranges = dict(ranges or {})
        self._next, self._lock = 0, threading.Lock()
        self._bytes, self._advised, self._errors = 0, 0, 0
        self._started = time.perf_counter()
        self._ended: float | None = None
        count = max(1, min(threads, len(self.files)))
        self._threads = [
            threading.Thread(target=self._work, name=f"dicache-prefetch-{i}", daemon=True) for i in range(count)
        ]
        self._running = len(self._threads) if self.files else 0

    def start(self) -> Prefetch:
        if self.files:
            for thread in self._threads:
                thread.start()
        else:
            self._ended = self._started
        return self

    def _work(self) -> None:
        buffer = bytearray(CHUNK_BYTES)
        while True:
            with self._lock:
                if self._next >= len(self.files):
                    break
                index, file = self._next, self.files[self._next]
                self._next += 1
            advise = index < self.read_ahead and hasattr(os, "posix_fadvise")
            try:
                read = _read_ahead(file, self.ranges.get(str(file))) if advise else _read_through(file, buffer)
            except OSError:
                read = None
            with self._lock:
                if read is None:
                    self._errors += 1
                elif advise:
                    self._advised += read
                else:
                    self._bytes += read
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._ended = time.perf_counter()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._ended is not None

    def report(self) -> dict[str, Any]:
        """Files, GB read, how many of the files were start-up files and their GB handed to the kernel's read-ahead,
        unreadable files, seconds so far (or until done), whether done."""
        with self._lock:
            end = self._ended if self._ended is not None else time.perf_counter()
            return {
                "files": len(self.files),
                "GB": round(self._bytes / 1e9, 3),
                "startup_files": self.read_ahead,
                "startup_GB": round(self._advised / 1e9, 3),
                "unreadable": self._errors,
                "seconds": round(end - self._started, 2),
                "done": self._ended is not None,
            }


def _read_through(file: pathlib.Path, buffer: bytearray) -> int:
    """Read `file` from start to end into `buffer`, chunk after chunk (the page cache keeps it); returns its bytes."""
    fd = os.open(file, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        total, view = 0, memoryview(buffer)
        while got := os.readv(fd, [view]):
            total += got
        return total
    finally:
        os.close(fd)


def _read_ahead(file: pathlib.Path, ranges: Sequence[tuple[int, int]] | None = None) -> int:
    """Ask the kernel to read `file` into the page cache, whole or the byte ranges `(offset, length)` of `ranges`,
    without waiting and without a copy here; returns the bytes asked for."""
    fd = os.open(file, os.O_RDONLY)
    try:
        if ranges is None:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            return os.fstat(fd).st_size
        for offset, length in ranges:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        return sum(length for _, length in ranges)
    finally:
        os.close(fd)


_current: Prefetch | None = None
ENTERED: float | None = None
"""When the command line's entry called `start_prefetch` (Unix time): the interpreter's and `dicache`'s own start
before it, the command's modules (torch, the server) imported after (`StartupTimeline.imports_done`)."""


def start_prefetch(argv: Sequence[str]) -> Prefetch | None:
    """Start reading what the command line `argv` will load (`argv_request`, `files_to_prefetch`); the running
    prefetch is `current()`. None where there is nothing to read."""
    global _current, ENTERED
    ENTERED = time.time()
    request = argv_request(argv)
    if request is None:
        return None
    memory = available_memory()
    code, weights = _prefetch_parts(request["model"], request["store"])
    files = within(code + weights, memory and int(memory * MEMORY_SHARE))
    if not files:
        return None
    ranges = startup_files.listed_ranges(request["store"])  # of the code files' libraries
    _current = Prefetch(files, read_ahead=min(len(code), len(files)), ranges=ranges).start()  # code files first
    return _current


def current() -> Prefetch | None:
    """The prefetch this process started, if any."""
    return _current
