"""The compile-artifact store's parts that need no torch, so that the prefetch (`prefetch`) can use them before the
process imports torch: where the store is (`ARTIFACT_ENV`, `artifact_store`), a weight snapshot's folder and manifest
names (`weight_snapshot`), the fingerprint of a file (its size and sampled bytes) that keys a snapshot to its
checkpoint, and an installed package's version (`installed_version`), which the keys include."""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

ARTIFACT_ENV = "DICACHE_COMPILE_ARTIFACT"
"""The environment variable naming the artifact store when `--compile-artifact` is not given."""


def artifact_store(option: str | os.PathLike | None, environ: Mapping[str, str] | None = None) -> pathlib.Path | None:
    """The store `--compile-artifact` names, else `DICACHE_COMPILE_ARTIFACT` of `environ` (default: this process's
    environment), else None (no artifact). An empty value counts as not given."""
    env = os.environ if environ is None else environ
    value = os.fspath(option) if option is not None else env.get(ARTIFACT_ENV, "")
    return pathlib.Path(os.path.expanduser(value)) if value.strip() else None


def installed_version(distribution: str) -> str | None:
    """An installed distribution's version, read from its metadata without importing it; None when it is not
    installed."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def weight_snapshot_store(
    compile_artifact: str | os.PathLike | None,
    *,
    compile: bool,
    artifact_weights: bool,
    quantized: bool,
    at_load: bool,
) -> pathlib.Path | None:
    """Where loading keeps and finds the quantised weights (`weight_snapshot`): the compile-artifact store
    (`artifact_store` of `compile_artifact`) when the model is compiled, `--artifact-weights` is on, a quantisation
    is asked for and applied while loading (`at_load`: one process, not offloaded); else None. The one rule for
    `dicache serve` / `generate` and each Ray Serve replica."""
    if not (compile and artifact_weights and quantized and at_load):
        return None
    return artifact_store(compile_artifact)


MANIFEST = "manifest.json"
PREFIX = "weights-"
"""A snapshot's folder in a store: `PREFIX` + the first 16 hex digits of its key's SHA-256."""
SAMPLES = 16
SAMPLE_BYTES = 64 << 10


def fingerprint(file: str | os.PathLike) -> dict[str, Any]:
    """`{"bytes": size, "sha256": ...}` of a file: SHA-256 over its first `SAMPLE_BYTES` (a safetensors header) and
    `SAMPLES` stretches of `SAMPLE_BYTES` spread evenly through it. About 1 MB read per file, whatever its size."""
    path = pathlib.Path(file)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        for i in range(SAMPLES + 1):
            fh.seek(i * max(0, size - SAMPLE_BYTES) // SAMPLES)
            digest.update(fh.read(SAMPLE_BYTES))
    return {"bytes": size, "sha256": digest.hexdigest()}


def checkpoint_fingerprint(folder: str | os.PathLike) -> dict[str, Any]:
    """Each weight and JSON file of a component folder by name (`fingerprint`)."""
    folder = pathlib.Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json"))
    return {p.name: fingerprint(p) for p in files}
