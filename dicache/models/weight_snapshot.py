"""Quantised weights kept beside the compile artifact, so that a fresh process reads them instead of quantising: an
FP8 transformer is half its checkpoint's bytes, and the quantisation phase (about 9 s for full-size Krea-2 on an
H200) disappears (docs/startup.md).

A snapshot is one component's state after loading and quantising, in the component's final form: torchao's quantised
weights flattened into plain tensors by torchao's own safetensors support (`flatten_tensor_state_dict`; their
attributes as JSON), every other tensor as it is. Layout in a store (`--compile-artifact PATH`):
`PATH/weights-<digest>/manifest.json` and `PATH/weights-<digest>/shard-00001.safetensors`, ..., `digest` the first 16
hex digits of the key's SHA-256. Shards of at most `SHARD_BYTES`, read in parallel straight onto the device
(`tensor_files.read_tensor_files`).

The key (`snapshot_key`) is what the stored values depend on: the component's checkpoint files (`fingerprint`: each
file's size and a SHA-256 of its header and of bytes sampled through it, so that a retrained checkpoint of the same
shapes is another key), the quantisation, the dtype, and the torch, torchao and dicache versions that wrote it.

`WeightSnapshots.load` and `.save` never raise for what a disk can do (none yet, another key, a truncated or altered
shard, a read-only store): each logs one line on this module's logger and returns an `ArtifactOutcome`; the caller
then loads and quantises the checkpoint as it would have anyway.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pathlib
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .compile_artifact import (
    DIGEST_CHARS,
    ArtifactKey,
    ArtifactOutcome,
    dicache_version,
    replace_folder,
)
from .store_layout import MANIFEST, PREFIX, checkpoint_fingerprint, fingerprint, installed_version
from .tensor_files import TensorFileError, read_tensor_files

FORMAT = 1
SHARD_BYTES = 2 << 30
"""Largest shard: several shards of a large component are read in parallel."""
log = logging.getLogger(__name__)


def snapshot_key(component: str, folder: str | os.PathLike, quantization: str, dtype: torch.dtype) -> ArtifactKey:
    """The key of `component`'s snapshot: its checkpoint files in `folder`, `quantization` (its spec in words), the
    dtype and the software that writes the values (module docstring)."""
    return ArtifactKey(
        {
            "component": component,
            "checkpoint": json.dumps(checkpoint_fingerprint(folder), sort_keys=True),
            "quantization": quantization,
            "dtype": str(dtype),
            "torch": torch.__version__,
            "torchao": installed_version("torchao") or "none",
            "dicache": dicache_version(),
            "format": str(FORMAT),
        }
    )


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` by qualified name, the buffers a state dict leaves out included: a
    model built on the meta device has those on the meta device too (a text encoder's rotary frequencies)."""
    named = (*module.named_parameters(), *module.named_buffers())
    return {name: tensor.detach() for name, tensor in named}  # a parameter's own tensor, as a state dict gives it


QUANTIZED = "@torchao."
"""The prefix of the stored parts of a torchao tensor (`flatten`): apart from every module's own names, and giving
torchao's safetensors support the `module.weight` form it needs even for a top-level weight."""


def flatten(
    tensors: Mapping[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor, tuple[str, str] | None]]:
    """`(stored name, plain tensor on the host, metadata)` for each of `tensors` (`module_tensors`), one at a time: a
    plain tensor as it is (metadata None); each part of a torchao tensor under `QUANTIZED` + torchao's flattened name,
    the first part with `(name, the JSON that rebuilds it)`. One tensor at a time, so that no more than one weight's
    copy exists on the device beside the model (torchao's flattening clones)."""
    for name, tensor in tensors.items():
        if type(tensor) is torch.Tensor:
            yield name, tensor.contiguous().cpu(), None
            continue
        from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict  # torchao weights

        parts, metadata = flatten_tensor_state_dict({QUANTIZED + name: tensor})
        first = True
        for part, value in parts.items():
            yield part, value.contiguous().cpu(), (name, metadata[QUANTIZED + name]) if first else None
            first = False


def unflatten(tensors: dict[str, torch.Tensor], metadata: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """`flatten`'s inverse: the module's tensors by name, torchao's rebuilt from `metadata` ({name: JSON})."""
    state = {name: t for name, t in tensors.items() if not name.startswith(QUANTIZED)}
    parts = {name: t for name, t in tensors.items() if name.startswith(QUANTIZED)}
    if not metadata and not parts:
        return state
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict  # torchao weights

    names = [QUANTIZED + name for name in metadata]
    rebuilt, left = unflatten_tensor_state_dict(
        parts, {"tensor_names": json.dumps(names), **{QUANTIZED + n: m for n, m in metadata.items()}}
    )
    if left or len(rebuilt) != len(names):
        missing = sorted(set(names) - rebuilt.keys())
        raise ValueError(
            f"quantised weights do not match their metadata: parts {sorted(left)[:4]} left over, "
            f"weights {missing[:4]} incomplete"
        )
    state.update((name[len(QUANTIZED) :], tensor) for name, tensor in rebuilt.items())
    return state


def assign_state(module: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Put `state` into `module` (built on the meta device, in its quantised structure) as its own tensors: exactly
    the names and logical shapes of `module_tensors`, else ValueError naming them. A parameter keeps the
    `requires_grad` the module built for it has (a torchao tensor none, as torchao's `quantize_` leaves it; a plain
    weight the module's default), as loading and quantising the checkpoint gives it: the compile caches key a graph
    on it, so a snapshot that changed it would miss every graph a process without the snapshot compiled."""
    expected = module_tensors(module)
    missing, unknown = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    wrong = [k for k in expected.keys() & state.keys() if tuple(expected[k].shape) != tuple(state[k].shape)]
    if missing or unknown or wrong:
        raise ValueError(
            f"{source} does not fit {type(module).__name__}: missing {missing[:4]}, unknown {unknown[:4]}, "
            f"wrong shape {sorted(wrong)[:4]}"
        )
    for key, tensor in state.items():
        owner_name, _, name = key.rpartition(".")
        owner = module.get_submodule(owner_name)
        if name in owner._parameters:
            grad = type(tensor) is torch.Tensor and owner._parameters[name].requires_grad
            setattr(owner, name, nn.Parameter(tensor, requires_grad=grad))
        else:
            owner._buffers[name] = tensor
    still_meta = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if still_meta:
        raise ValueError(f"{source} leaves {type(module).__name__} tensors on the meta device: {still_meta[:4]}")


class WeightSnapshots:
    """The weight snapshots of one store (module docstring)."""

    def __init__(self, store: str | os.PathLike) -> None:
        self.store = pathlib.Path(store)

    def folder(self, key: ArtifactKey) -> pathlib.Path:
        return self.store / f"{PREFIX}{key.digest[:DIGEST_CHARS]}"

    def _outcome(self, key: ArtifactKey, start: float, status: str, message: str, level: int, **extra: int):
        log.log(level, "weight snapshot %s (%s): %s", self.store, key.fields.get("component", "?"), message)
        seconds = round(time.perf_counter() - start, 3)
        return ArtifactOutcome(status, str(self.folder(key)), seconds, message=message, **extra)

    def load(self, key: ArtifactKey, module: nn.Module, device: torch.device | str) -> ArtifactOutcome:
        """Fill `module` (built on the meta device and given its quantised structure) with the snapshot of `key`,
        read straight onto `device`. Status `loaded`, or `absent` / `mismatch` / `unreadable` with `module` left
        unusable (the caller builds and loads it from its checkpoint instead)."""
        start = time.perf_counter()
        folder = self.folder(key)
        manifest_path = folder / MANIFEST

        def outcome(status: str, message: str, level: int = logging.WARNING, **extra: int) -> ArtifactOutcome:
            return self._outcome(key, start, status, message, level, **extra)

        try:
            if not manifest_path.is_file():
                others = self._keys(key.fields.get("component"))
                if not others:
                    return outcome(
                        "absent", "none for this checkpoint and quantisation yet; quantising at load", logging.INFO
                    )
                nearest = min(others, key=lambda fields: len(key.differences(fields)))
                why = ", ".join(name.partition(":")[0] for name in key.differences(nearest))
                return outcome(
                    "mismatch",
                    f"none for this key ({len(others)} for others; the nearest differs in: {why}); quantising at load",
                )
            manifest = json.loads(manifest_path.read_text())
            if not isinstance(manifest, dict) or manifest.get("key") != dict(key.fields):
                theirs = manifest.get("key") if isinstance(manifest, dict) else None
                why = "; ".join(key.differences(theirs if isinstance(theirs, dict) else {})) or "format"
                return outcome("mismatch", f"{folder.name} was written for another key ({why}); quantising at load")
            shards = manifest.get("shards") or {}
            files = [folder / name for name in sorted(shards)]
            for file in files:
                if fingerprint(file) != shards[file.name]:
                    return outcome(
                        "unreadable",
                        f"{file} is truncated or altered (size or sampled bytes differ from "
                        "the manifest); quantising at load",
                    )
            tensors = dict(read_tensor_files(files, device))
            assign_state(module, unflatten(tensors, manifest.get("metadata") or {}), str(folder))
        except (OSError, ValueError, TypeError, KeyError, TensorFileError) as exc:
            return outcome("unreadable", f"cannot use it ({type(exc).__name__}: {exc}); quantising at load")
        size = sum(shard["bytes"] for shard in shards.values())
        return outcome(
            "loaded",
            f"loaded {folder.name} ({size / 1e9:.2f} GB) in {time.perf_counter() - start:.1f} s",
            logging.INFO,
            files=len(files),
            bytes=size,
        )

    def _keys(self, component: str | None) -> list[dict]:
        """The keys of the store's readable snapshots of `component`."""
        found = []
        for manifest in sorted(self.store.glob(f"{PREFIX}*/{MANIFEST}")) if self.store.is_dir() else ():
            try:
                fields = json.loads(manifest.read_text()).get("key")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(fields, dict) and fields.get("component") == component:
                found.append(fields)
        return found

    def save(self, key: ArtifactKey, module: nn.Module, shard_bytes: int = SHARD_BYTES) -> ArtifactOutcome:
        """Write `module`'s state as the snapshot of `key`, replacing one of the same key; readers never see a
        partial one (written beside it, then renamed into place). Never raises for a store that cannot be written."""
        start = time.perf_counter()
        folder = self.folder(key)
        staging: pathlib.Path | None = None
        try:
            from safetensors.torch import save_file  # loading never needs it: `tensor_files` reads the format

            self.store.mkdir(parents=True, exist_ok=True)
            staging = self.store / f".writing-{uuid.uuid4().hex}"
            staging.mkdir()
            shards: dict[str, Any] = {}
            metadata: dict[str, str] = {}
            pending: dict[str, torch.Tensor] = {}
            pending_bytes = 0

            def write() -> None:  # the tensors gathered so far as the next shard; the host holds one shard at most
                file = staging / f"shard-{len(shards) + 1:05d}.safetensors"
                save_file(pending, str(file))
                shards[file.name] = fingerprint(file)
                pending.clear()

            for name, tensor, rebuild in flatten(module_tensors(module)):
                nbytes = tensor.numel() * tensor.element_size()
                if pending and pending_bytes + nbytes > shard_bytes:
                    write()
                    pending_bytes = 0
                pending[name] = tensor
                pending_bytes += nbytes
                if rebuild is not None:
                    metadata[rebuild[0]] = rebuild[1]
            if pending or not shards:
                write()
            manifest = {
                "format": FORMAT,
                "key": dict(key.fields),
                "digest": key.digest,
                "shards": shards,
                "metadata": metadata,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
            replace_folder(staging, folder)
            staging = None
        except (OSError, ValueError, RuntimeError) as exc:
            return self._outcome(
                key,
                start,
                "not_saved",
                f"cannot write it ({type(exc).__name__}: {exc}); the next start quantises at load again",
                logging.WARNING,
            )
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        size = sum(shard["bytes"] for shard in shards.values())
        return self._outcome(
            key,
            start,
            "saved",
            f"saved {folder.name} ({size / 1e9:.2f} GB, {len(shards)} shards) in {time.perf_counter() - start:.1f} s",
            logging.INFO,
            files=len(shards),
            bytes=size,
        )
