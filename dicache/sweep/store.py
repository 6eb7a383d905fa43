"""The sweep's output folder: finished cells as JSON lines (resumable), cached reference samples, model fingerprints.

Layout: `results.jsonl` (one record per finished cell, appended and flushed as each finishes), `refs/<key>.pt`
(the uncached sample of one pipeline, schedule, prompt and seed), `results.json` (everything, written by the runner).
A record is identified by `record["key"]`, a stable hash of what determines it; a rerun skips keys already present.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

RESULTS_JSONL = "results.jsonl"
RESULTS_JSON = "results.json"
REFS_DIR = "refs"
_FINGERPRINT_BYTES = 1 << 20


class ResultStore:
    """Append-only record log plus a reference-sample cache under `root`."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / RESULTS_JSONL
        self._records: dict[str, dict[str, Any]] = {}
        for record in self._read():
            self._records[record["key"]] = record

    def _read(self) -> Iterator[dict[str, Any]]:
        if not self.path.is_file():
            return
        with self.path.open() as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by an interruption: that cell reruns
                    continue
                if isinstance(record, dict) and "key" in record:
                    yield record

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def get(self, key: str) -> dict[str, Any] | None:
        return self._records.get(key)

    def records(self) -> list[dict[str, Any]]:
        return list(self._records.values())

    def add(self, record: dict[str, Any]) -> None:
        """Append one finished record and flush it to disk before returning."""
        line = json.dumps(record, sort_keys=True, allow_nan=False)
        with self.path.open("a") as f:
            if f.tell() > 0 and not self._ends_with_newline():
                f.write("\n")  # a previous run was cut mid-line
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._records[record["key"]] = record

    def _ends_with_newline(self) -> bool:
        with self.path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    # ------------------------------------------------------------------ reference samples
    def ref_path(self, key: str) -> Path:
        return self.root / REFS_DIR / f"{key}.pt"

    def load_ref(self, key: str) -> dict[str, Any] | None:
        path = self.ref_path(key)
        if not path.is_file():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # a partial file from an interruption: recompute
            return None

    def save_ref(self, key: str, data: dict[str, Any]) -> None:
        path = self.ref_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(data, tmp)
        os.replace(tmp, path)

    def write_json(self, data: dict[str, Any], name: str = RESULTS_JSON) -> Path:
        path = self.root / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=False, allow_nan=False) + "\n")
        os.replace(tmp, path)
        return path


def model_fingerprint(path: str | os.PathLike) -> str:
    """A stable id of a local checkpoint folder: hash of its JSON files and, per weight file, its size and first and
    last MiB. Hub repo ids (not local folders) are returned unchanged."""
    root = Path(path)
    if not root.is_dir():
        return str(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue
        if file.suffix == ".json":
            digest.update(rel.encode() + b"\0" + file.read_bytes())
        elif file.suffix in (".safetensors", ".bin", ".pt"):
            size = file.stat().st_size
            digest.update(f"{rel}\0{size}\0".encode())
            with file.open("rb") as f:
                digest.update(f.read(_FINGERPRINT_BYTES))
                if size > _FINGERPRINT_BYTES:
                    f.seek(max(_FINGERPRINT_BYTES, size - _FINGERPRINT_BYTES))
                    digest.update(f.read())
    return digest.hexdigest()[:16]
