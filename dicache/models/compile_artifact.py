"""A compile artifact that travels: what `torch.compile` wrote to disk while a process compiled and warmed up, saved as
one folder per key, and put back in a fresh process before it compiles, so that each of its compiles is a cache hit
(docs/startup.md).

What it holds: a snapshot of inductor's cache folder (`TORCHINDUCTOR_CACHE_DIR`: FX graphs, AOTAutograd entries,
generated kernel sources, compiled host libraries, Triton kernels and their autotuning results) and of Triton's own
(`TRITON_CACHE_DIR`, when it is set apart from inductor's), in one tar file. The caches are content-addressed (a file's
name is a hash of what it holds), so the snapshot can be unpacked beside what a folder already holds, under another
path; torch still checks every entry against its own key, so a file that does not fit is a miss, never a wrong kernel.
Measured on the CPU against torch's portable "mega-cache" (`torch.compiler.save_cache_artifacts`), precompiled
functions and AOTInductor packages (docs/startup.md "Mechanism"): the snapshot is the only one whose fresh process
rebuilds nothing, the compiled host libraries included.

Layout of a store (`--compile-artifact PATH`): `PATH/<digest>/manifest.json` and `PATH/<digest>/caches.tar`, where
`digest` is the first 16 hex digits of the key's SHA-256. The key (`ArtifactKey`) is everything that changes the
kernels: torch, Triton, CUDA and cuDNN versions, the GPU, the model's configuration, quantisation, compile options and
the shapes warmed. One store can therefore hold the artifacts of several GPU types or models side by side.

`load_artifact` and `save_artifact` never raise for what a user's disk can do (no artifact, another key, a truncated,
corrupt or unreadable file, a read-only folder): each logs one line on this module's logger and returns an
`ArtifactOutcome`; the caller then compiles as it would have anyway.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import pathlib
import platform
import shutil
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .store_layout import MANIFEST, PREFIX, installed_version

FORMAT = 1
"""The manifest's format version; another version is read as a mismatch."""

PAYLOAD = "caches.tar"
DIGEST_CHARS = 16
_CHUNK = 8 << 20
_SKIPPED = ("locks",)  # inductor's lock files: per process, never content
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ArtifactKey:
    """What the kernels depend on, as text by name (`fields`); equal keys have equal `digest`s."""

    fields: Mapping[str, str]

    @property
    def digest(self) -> str:
        text = json.dumps(dict(self.fields), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def differences(self, other: Mapping[str, str]) -> list[str]:
        """The fields that differ from `other` (an artifact's), in words: `gpu: NVIDIA H200 here, NVIDIA H100 in
        the artifact`."""
        names = sorted(set(self.fields) | set(other))
        here, there = self.fields, other
        return [
            f"{name}: {_short(here.get(name, 'absent'))} here, {_short(there.get(name, 'absent'))} in the artifact"
            for name in names
            if here.get(name) != there.get(name)
        ]


def _short(value: str, limit: int = 60) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def runtime_fields(device: torch.device | str) -> dict[str, str]:
    """The key fields of this process's software and `device`: torch, Triton, CUDA, cuDNN, Python, the machine and,
    on CUDA, the GPU's name and compute capability."""
    device = torch.device(device)
    fields = {
        "torch": torch.__version__,
        "triton": installed_version("triton") or installed_version("pytorch-triton") or "none",
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "device": device.type,
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        fields["cudnn"] = str(torch.backends.cudnn.version())
        fields["gpu"] = torch.cuda.get_device_name(index)
        fields["capability"] = "{}.{}".format(*torch.cuda.get_device_capability(index))
    return fields


def dicache_version() -> str:
    """dicache's installed version ("unknown" in a source tree never installed)."""
    return installed_version("dicache") or "unknown"


def config_digest(config: Any) -> str:
    """A short SHA-256 of a configuration (a mapping, a dataclass or anything `str` describes exactly)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    text = json.dumps(config, sort_keys=True, default=str) if isinstance(config, Mapping) else str(config)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


@dataclasses.dataclass(frozen=True)
class ArtifactOutcome:
    """What `load_artifact` / `save_artifact` did. status: `loaded`, `saved`, `absent` (no artifact of any key),
    `mismatch` (artifacts of other keys only), `unreadable` (the artifact or its store cannot be read, is truncated
    or corrupt), `not_saved` (the store cannot be written), `empty` (nothing was compiled to save)."""

    status: str
    path: str
    seconds: float
    files: int = 0
    bytes: int = 0
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compile_cache_dirs() -> dict[str, pathlib.Path]:
    """Where this process's compiles read and write their caches: `inductor` (`TORCHINDUCTOR_CACHE_DIR`, else
    inductor's default under the temporary folder) and, when `TRITON_CACHE_DIR` is set to a folder outside it,
    `triton` (otherwise inductor keeps Triton's kernels in its own folder)."""
    try:  # seconds to import: only compiling needs it
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # torch before the module existed
        from torch._inductor.utils import cache_dir

    dirs = {"inductor": pathlib.Path(cache_dir())}
    triton = os.environ.get("TRITON_CACHE_DIR", "").strip()
    if triton:
        path = pathlib.Path(triton).absolute()
        if not path.is_relative_to(dirs["inductor"]):
            dirs["triton"] = path
    return dirs


def load_artifact(store: str | os.PathLike, key: ArtifactKey) -> ArtifactOutcome:
    """Put the artifact of `key` from `store` into this process's compile caches (`compile_cache_dirs`), before
    anything is compiled. Files the caches already hold are kept. Never raises for a missing, foreign, corrupt or
    unreadable artifact: it logs one line and returns the outcome (the process then compiles)."""
    start = time.perf_counter()
    store = pathlib.Path(store)
    folder = store / key.digest[:DIGEST_CHARS]

    def outcome(status: str, message: str, level: int = logging.WARNING, **extra: int) -> ArtifactOutcome:
        log.log(level, "compile artifact %s: %s", store, message)
        return ArtifactOutcome(status, str(folder), round(time.perf_counter() - start, 3), message=message, **extra)

    try:
        manifest = _read_manifest(folder / MANIFEST) if (folder / MANIFEST).is_file() else None
        if manifest is None:
            others = _manifests(store)
            if not others:
                return outcome("absent", "none here yet; compiling from scratch", logging.INFO)
            nearest = min(others, key=lambda m: len(key.differences(m.get("key", {}))))
            why = "; ".join(key.differences(nearest.get("key", {}))) or "its digest differs"
            return outcome("mismatch", f"none for this key ({len(others)} for others: {why}); compiling from scratch")
        if manifest.get("format") != FORMAT or manifest.get("key") != dict(key.fields):
            why = "; ".join(key.differences(manifest.get("key") or {})) or f"format {manifest.get('format')!r}"
            return outcome("mismatch", f"{folder.name} was made for another key ({why}); compiling from scratch")
        payload = manifest.get("payload") or {}
        tar_path = folder / PAYLOAD
        size = tar_path.stat().st_size
        if size != payload.get("bytes") or _sha256(tar_path) != payload.get("sha256"):
            return outcome(
                "unreadable",
                f"{tar_path} is truncated or corrupt ({size} bytes, manifest says {payload.get('bytes')}, or its "
                "SHA-256 differs); compiling from scratch",
            )
        files = _unpack(tar_path, compile_cache_dirs())
    except (OSError, ValueError, tarfile.TarError) as exc:
        return outcome("unreadable", f"cannot use it ({type(exc).__name__}: {exc}); compiling from scratch")
    message = f"loaded {folder.name} ({files} files, {size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s"
    return outcome("loaded", message, logging.INFO, files=files, bytes=size)


def save_artifact(
    store: str | os.PathLike, key: ArtifactKey, notes: Mapping[str, Any] | None = None
) -> ArtifactOutcome:
    """Save this process's compile caches (`compile_cache_dirs`) to `store` as the artifact of `key`, replacing one
    of the same key; readers never see a partial artifact (written beside it, then renamed into place). `notes`
    (JSON) are kept in the manifest. Never raises for a store that cannot be written: logs one line either way."""
    start = time.perf_counter()
    store = pathlib.Path(store)
    folder = store / key.digest[:DIGEST_CHARS]

    def outcome(status: str, message: str, level: int = logging.WARNING, **extra: int) -> ArtifactOutcome:
        log.log(level, "compile artifact %s: %s", store, message)
        return ArtifactOutcome(status, str(folder), round(time.perf_counter() - start, 3), message=message, **extra)

    staging: pathlib.Path | None = None
    try:
        sources = compile_cache_dirs()
        store.mkdir(parents=True, exist_ok=True)
        staging = store / f".writing-{uuid.uuid4().hex}"
        staging.mkdir()
        files, size, digest = _pack(sources, staging / PAYLOAD, exclude=store)
        if files == 0:
            return outcome("empty", "nothing compiled in this process: no artifact written", logging.INFO)
        manifest = {
            "format": FORMAT,
            "key": dict(key.fields),
            "digest": key.digest,
            "payload": {"file": PAYLOAD, "bytes": size, "sha256": digest, "files": files},
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "notes": dict(notes or {}),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        replace_folder(staging, folder)
        staging = None
    except OSError as exc:
        return outcome("not_saved", f"cannot write it ({type(exc).__name__}: {exc}); serving goes on without it")
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    message = f"saved {folder.name} ({files} files, {size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s"
    return outcome("saved", message, logging.INFO, files=files, bytes=size)


# ---------------------------------------------------------------------------------------------------------- files
def _read_manifest(path: pathlib.Path) -> dict:
    manifest = json.loads(path.read_text())
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is not a JSON object")
    return manifest


def _manifests(store: pathlib.Path) -> list[dict]:
    """The readable manifests of `store`'s artifacts (none when the store does not exist); the weight snapshots kept
    beside them (`PREFIX` folders, `weight_snapshot`) are not artifacts."""
    if not store.is_dir():
        return []
    found = []
    for child in sorted(store.iterdir()):
        if child.name.startswith((".", PREFIX)) or not (child / MANIFEST).is_file():
            continue
        try:
            found.append(_read_manifest(child / MANIFEST))
        except (OSError, ValueError):
            continue
    return found


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _HashingWriter:
    """A write-only file object that counts and hashes what goes through it."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.size, self.digest = fh, 0, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.fh.write(data)


def _cache_files(root: pathlib.Path, exclude: pathlib.Path) -> Iterator[pathlib.Path]:
    """Regular files under `root`, sorted; lock folders, lock files and anything under `exclude` left out."""
    exclude = exclude.absolute()
    for folder, dirs, names in os.walk(root):
        here = pathlib.Path(folder)
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED and not (here / d).absolute().is_relative_to(exclude))
        for name in sorted(names):
            path = here / name
            if not name.endswith(".lock") and path.is_file() and not path.is_symlink():
                yield path


def _pack(sources: Mapping[str, pathlib.Path], target: pathlib.Path, exclude: pathlib.Path) -> tuple[int, int, str]:
    """Tar every cache file of `sources` (arcname `<source name>/<path inside it>`) into `target`; returns (files,
    bytes, sha256 hex)."""
    files = 0
    with target.open("wb") as fh:
        writer = _HashingWriter(fh)
        with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for name, root in sources.items():
                if not root.is_dir():
                    continue
                for path in _cache_files(root, exclude):
                    info = tar.gettarinfo(str(path), arcname=f"{name}/{path.relative_to(root).as_posix()}")
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    with path.open("rb") as data:
                        tar.addfile(info, data)
                    files += 1
    return files, writer.size, writer.digest.hexdigest()


def _unpack(tar_path: pathlib.Path, targets: Mapping[str, pathlib.Path]) -> int:
    """Write each regular file of the tar to its cache folder (`targets[<first path part>]`) unless a file of that
    name is there already (a cache file's name is its content's hash); each file is written beside its place and
    renamed into it, so a compile in another process never reads half a file. Returns the files written."""
    written = 0
    with tarfile.open(tar_path, mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            source, _, inner = member.name.partition("/")
            root = targets.get(source)
            parts = pathlib.PurePosixPath(inner).parts
            if root is None or not parts or ".." in parts or inner.startswith("/"):
                continue
            destination = root.joinpath(*parts)
            if destination.exists():
                continue
            destination.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member)
            if data is None:
                continue
            handle, temporary = tempfile.mkstemp(dir=destination.parent, prefix=".unpack-")
            try:
                with os.fdopen(handle, "wb") as out:
                    shutil.copyfileobj(data, out, _CHUNK)
                os.chmod(temporary, member.mode & 0o777 or 0o644)
                os.replace(temporary, destination)
            except BaseException:
                pathlib.Path(temporary).unlink(missing_ok=True)
                raise
            written += 1
    return written


def replace_folder(staging: pathlib.Path, folder: pathlib.Path) -> None:
    """Rename `staging` to `folder`, moving a folder already there out of the way first (and deleting it after)."""
    old = None
    if folder.exists():
        old = folder.with_name(f".replaced-{uuid.uuid4().hex}")
        folder.rename(old)
    staging.rename(folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------- counters
def compile_counters() -> dict[str, int]:
    """torch.compile's own counters so far in this process: graphs compiled by dynamo, and the hits and misses of
    inductor's FX graph cache and of the AOTAutograd cache (a process that loaded a complete artifact compiles
    graphs with hits only; a bypass is a graph the cache cannot hold, compiled every time)."""
    from torch._dynamo.utils import counters  # seconds to import: only compiling needs it

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "fx_graph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fx_graph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "fx_graph_cache_bypass": int(counters["inductor"]["fxgraph_cache_bypass"]),
        "aot_autograd_cache_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "aot_autograd_cache_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
        "aot_autograd_cache_bypass": int(counters["aot_autograd"]["autograd_cache_bypass"]),
    }


def compile_time_totals() -> dict[str, float]:
    """Seconds torch.compile's timed steps took so far in this process, summed per step (dynamo's
    `compilation_time_metrics`: e.g. `_compile.compile_inner` for a whole frame, `compile_fx_inner`, a cache load);
    the steps nest, so their seconds overlap. Subtract two readings for what happened between them."""
    from torch._dynamo.utils import compilation_time_metrics  # seconds to import: only compiling needs it

    return {name: float(sum(values)) for name, values in compilation_time_metrics.items()}


def compile_time_spent(before: dict[str, float], top: int = 10) -> dict[str, float]:
    """The `top` steps that took longest since `before` (a `compile_time_totals` reading), seconds each, longest
    first; steps that took no time are left out."""
    spent = {name: total - before.get(name, 0.0) for name, total in compile_time_totals().items()}
    longest = sorted(((round(s, 2), name) for name, s in spent.items() if round(s, 2) > 0), reverse=True)[:top]
    return {name: seconds for seconds, name in longest}


def compile_events(since: int = 0) -> list[dict[str, Any]]:
    """The frames torch.compile compiled in this process, from the `since`-th on (torch keeps the last few dozen):
    where (file:function), and seconds: whole compile, inside inductor, compiling Triton kernels, autotuning them."""
    from torch._dynamo.utils import get_compilation_metrics  # seconds to import: only compiling needs it

    events = []
    for metrics in list(get_compilation_metrics())[since:]:

        def seconds(name: str, scale: float = 1.0, source: Any = metrics) -> float | None:
            value = getattr(source, name, None)
            return None if value is None else round(value * scale, 2)

        events.append(
            {
                "frame": f"{pathlib.Path(metrics.co_filename or '?').name}:{metrics.co_name}:{metrics.co_firstlineno}",
                "seconds": seconds("entire_frame_compile_time_s"),
                "inductor_s": seconds("inductor_compile_time_s"),
                "triton_s": seconds("triton_compile_time_us", 1e-6),
                "autotune_s": seconds("runtime_triton_autotune_time_us", 1e-6),
                "fx_cache_hits": getattr(metrics, "inductor_fx_local_cache_hit_count", None),
            }
        )
    return events


def compile_event_count() -> int:
    """How many compile events torch keeps now (`compile_events(since=...)` starts after them)."""
    from torch._dynamo.utils import get_compilation_metrics  # seconds to import: only compiling needs it

    return len(list(get_compilation_metrics()))
