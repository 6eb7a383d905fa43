"""Krea-2 checkpoints on disk: the embedded ones, partial checkpoints and their base, and loading the components.

A diffusers-layout folder holds `model_index.json` and one folder per component; an optional `dicache.json` beside
it gives the default image size, sample prompts and, for a checkpoint that holds only what differs from another one
(the embedded Turbo student), `base_checkpoint`: the folder or hub repo whose components fill what it lacks, with
`base_files_sha256` fingerprints of the components it was trained with.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from dicache.models.compile_artifact import ArtifactKey
from dicache.models.krea2.scheduler import FlowMatchEulerScheduler
from dicache.models.krea2.text import Krea2TextEncoder
from dicache.models.krea2.transformer import Krea2Transformer
from dicache.models.krea2.vae import QwenImageVAEDecoder
from dicache.models.loading import (
    CheckpointError,
    check_load_format,
    hidden_packages,
    read_json,
    resolve_component_dir,
)
from dicache.models.weight_snapshot import WeightSnapshots, snapshot_key
from dicache.quantization import QuantizationError, QuantizationSpec, quantize_text_encoder, quantize_transformer
from dicache.quantization.weights import EMULATED_METHODS, quantized_structure

EMBEDDED_CHECKPOINT = pathlib.Path(__file__).resolve().parents[2] / "assets" / "krea2-tiny"
"""The small trained Krea-2-architecture checkpoint shipped with dicache (the default model)."""
EMBEDDED_TURBO_CHECKPOINT = EMBEDDED_CHECKPOINT.with_name("krea2-tiny-turbo")
"""Its distilled 8-step, CFG-free student (transformer and scheduler; the rest comes from `EMBEDDED_CHECKPOINT`)."""


def load_components(
    path_or_repo_id: str | os.PathLike,
    dtype: torch.dtype,
    device: torch.device,
    base: str | os.PathLike | None = None,
    load_format: str = "auto",
    *,
    quantization: QuantizationSpec | None = None,
    text_encoder_quantization: str | None = None,
    timings: dict[str, float] | None = None,
    reads: dict[str, dict[str, float]] | None = None,
    weight_store: str | os.PathLike | None = None,
    snapshots: dict[str, dict[str, Any]] | None = None,
    **hub_kwargs: Any,
) -> dict[str, Any]:
    """The keyword arguments of `Krea2Pipeline(...)` for the checkpoint at `path_or_repo_id` (see
    `Krea2Pipeline.from_pretrained`): its components, loaded on `device` in `dtype`, and its metadata.

    Components this checkpoint lacks come from its base checkpoint (`base`, else `dicache.json`'s pointer), whose
    fingerprints are checked first; components in neither (no text encoder, no VAE) are None.

    Quantisation while loading, so that start-up never holds more than serving: with `quantization` each
    transformer block is quantised as soon as its weights are read (`quantize_transformer(..., only=...)`: the same
    model as quantising it whole afterwards), and with `text_encoder_quantization` the text encoder right after it is
    loaded, before the VAE. The components load in that order: transformer, text encoder, VAE. `timings` (when given)
    receives seconds by phase: `imports` (transformers' model code), `weights` (reading or drawing the weights) and
    `quantization`; `reads` (when given),
    per component read from files: `seconds` of reading (quantisation excluded) and `bytes` of its weight files.

    `weight_store` (a compile-artifact store, `--compile-artifact`): with `quantization`, the quantised transformer is
    read from its snapshot there (`weight_snapshot`: no quantisation, the quantised bytes) when one was saved for
    this checkpoint and quantisation, and saved there after quantising when none was; `snapshots` (when given)
    receives each outcome by name (`transformer`, `transformer_saved`).
    """
    root = resolve_component_dir(path_or_repo_id, None, **hub_kwargs)
    index = read_json(root, "model_index.json")
    check_load_format(load_format)
    extras = _read_optional_json(root / "dicache.json")
    base_root = resolve_base_checkpoint(root, extras, base, **hub_kwargs)
    base_extras = _read_optional_json(base_root / "dicache.json") if base_root is not None else {}
    if base_root is not None:
        check_base_files(root, extras, base_root)

    def source(*names: str) -> str | os.PathLike | None:
        """Where components `names` load from: this checkpoint if it has them all, else the base (or None)."""
        if all((root / n).is_dir() for n in names):
            return path_or_repo_id
        return base_root

    weights = dict(dtype=dtype, device=device, load_format=load_format, **hub_kwargs)
    clock = _PhaseClock()
    text_listed = _component_listed(index, "text_encoder") and _component_listed(index, "tokenizer")
    text_code = _import_text_encoder_code_meanwhile(quantization) if text_listed else None
    transformer = load_transformer(
        path_or_repo_id,
        quantization,
        weight_store,
        clock=clock,
        outcomes=snapshots,
        bytes=_weight_bytes(root / "transformer", load_format),
        **weights,
    )
    scheduler = FlowMatchEulerScheduler.from_pretrained(path_or_repo_id, subfolder="scheduler", **hub_kwargs)
    text_encoder = None
    text_source = source("tokenizer", "text_encoder")
    if text_listed and text_source:
        folder = pathlib.Path(resolve_component_dir(text_source, "text_encoder", **hub_kwargs))
        with clock.phase("imports"):  # transformers' model code: seconds, not the weights' reading
            if text_code is not None:
                text_code.join()  # imported while the transformer loaded; what is left of it is waited for here
            _import_text_encoder_code()
        text_encoder = load_text_encoder(
            text_source,
            text_encoder_quantization,
            weight_store,
            clock=clock,
            outcomes=snapshots,
            bytes=_weight_bytes(folder, load_format),
            **weights,
        )
    elif text_encoder_quantization is not None:
        raise QuantizationError("text encoder quantization: this checkpoint has no text encoder")
    vae = None
    if _component_listed(index, "vae") and source("vae") is not None:
        folder = pathlib.Path(resolve_component_dir(source("vae"), "vae", **hub_kwargs))
        with clock.phase("weights", _weight_bytes(folder, load_format), "vae"):
            vae = QwenImageVAEDecoder.from_pretrained(source("vae"), subfolder="vae", **weights)
    if timings is not None:
        timings.update(clock.seconds)
    if reads is not None:
        reads.update(clock.reads)
    size = extras.get("default_size", base_extras.get("default_size", [1024, 1024]))
    return dict(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        patch_size=int(index.get("patch_size", 2)),
        is_distilled=bool(index.get("is_distilled", False)),
        default_size=(int(size[0]), int(size[1])),
        sample_prompts=extras.get("sample_prompts", base_extras.get("sample_prompts")),
    )


def _import_text_encoder_code() -> None:
    """Import transformers' model code the text encoder is built of, torchao hidden from it
    (`Krea2TextEncoder.from_pretrained` imports it the same way)."""
    with hidden_packages("torchao"):
        from transformers import AutoTokenizer, Qwen3VLModel  # noqa: F401


def _import_text_encoder_code_meanwhile(quantization: QuantizationSpec | None) -> threading.Thread | None:
    """Start importing the text encoder's model code (`_import_text_encoder_code`, seconds of Python) on a thread,
    so that it runs while the transformer is read (the main thread mostly waits for the disk then). Only where hiding
    torchao from it changes nothing another thread could see: torchao imported already (it is imported here first
    when `quantization` will need it) or not installed; otherwise None and the import runs in its place, as before.
    A failure on the thread is left to the import in its place, which raises it."""
    if quantization is not None and quantization.method not in EMULATED_METHODS:
        with contextlib.suppress(ImportError):
            import torchao  # noqa: F401 - the transformer's quantisation imports it anyway
    if "torchao" not in sys.modules and importlib.util.find_spec("torchao") is not None:
        return None

    def run() -> None:
        with contextlib.suppress(Exception):
            _import_text_encoder_code()

    thread = threading.Thread(target=run, name="dicache-text-encoder-imports", daemon=True)
    thread.start()
    return thread


def load_transformer(
    path_or_repo_id: str | os.PathLike,
    quantization: QuantizationSpec | None = None,
    weight_store: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    clock: _PhaseClock | None = None,
    outcomes: dict[str, Any] | None = None,
    bytes: int = 0,
    **hub_kwargs: Any,
) -> Krea2Transformer:
    """The checkpoint's transformer on `device`, quantised by `quantization` as each block is read, or read from its
    quantised snapshot in `weight_store` (see `load_components`), which is saved there when there was none. `clock`
    times the phases (`weights`, `quantization`, `snapshot_save`; `bytes`: the checkpoint's, for its read rate),
    `outcomes` receives the snapshot's (`transformer`, `transformer_saved`)."""
    clock = clock if clock is not None else _PhaseClock()
    outcomes = outcomes if outcomes is not None else {}
    # an emulated quantization keeps its rounded weights outside the state dict: nothing a snapshot could restore
    snapshot = quantization is not None and quantization.method not in EMULATED_METHODS
    store = _snapshot_store(weight_store, snapshot, load_format)
    if store is not None:
        folder = pathlib.Path(resolve_component_dir(path_or_repo_id, "transformer", **hub_kwargs))
        key = snapshot_key("transformer", folder, repr(quantization), dtype)

        def build() -> Krea2Transformer:
            model = Krea2Transformer.from_config(read_json(folder, "config.json"), folder)
            quantized_structure(model, quantization)
            return model

        transformer = _from_snapshot(store, key, "transformer", build, lambda model: model, device, clock, outcomes)
        if transformer is not None:
            transformer.quantization = quantization
            return transformer

    def quantize_block(model: Krea2Transformer, name: str) -> None:
        with clock.phase("quantization"):
            quantize_transformer(model, quantization, only=lambda linear: linear.startswith(name + "."))

    with clock.phase("weights", bytes, "transformer"):
        transformer = Krea2Transformer.from_pretrained(
            path_or_repo_id,
            subfolder="transformer",
            dtype=dtype,
            device=device,
            load_format=load_format,
            on_block=quantize_block if quantization is not None else None,
            **hub_kwargs,
        )
    if quantization is not None:
        blocks = tuple(name + "." for name in transformer.block_names())
        with clock.phase("quantization"):  # whatever the selection holds outside the blocks (nothing by default)
            quantize_transformer(transformer, quantization, only=lambda linear: not linear.startswith(blocks))
        transformer.quantization = quantization
    if store is not None:
        _save_snapshot(store, key, "transformer", transformer, clock, outcomes)
    return transformer


SNAPSHOT_TEXT_ENCODER_METHODS = ("fp8",)
"""Text-encoder quantisations kept as snapshots: FP8 storage (plain tensors, built on any device). `fp8-dynamic`
needs torchao's FP8 set-up on a CUDA device, which a model on the meta device cannot take: it quantises at load."""


def load_text_encoder(
    source: str | os.PathLike,
    method: str | None = None,
    weight_store: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    clock: _PhaseClock | None = None,
    outcomes: dict[str, Any] | None = None,
    bytes: int = 0,
    **hub_kwargs: Any,
) -> Krea2TextEncoder:
    """The text encoder of `source` on `device`, quantised by `method` (`quantize_text_encoder`) after loading, or read
    from its quantised snapshot in `weight_store` (`weight_snapshot`; `SNAPSHOT_TEXT_ENCODER_METHODS`), which is
    saved there when there was none. `clock`, `outcomes` (`text_encoder`, `text_encoder_saved`), `bytes`: as for
    `load_transformer`."""
    clock = clock if clock is not None else _PhaseClock()
    outcomes = outcomes if outcomes is not None else {}
    store = _snapshot_store(weight_store, method in SNAPSHOT_TEXT_ENCODER_METHODS, load_format)
    if store is not None:
        folder = pathlib.Path(resolve_component_dir(source, "text_encoder", **hub_kwargs))
        key = snapshot_key("text_encoder", folder, f"text encoder {method}", dtype)

        def build() -> Krea2TextEncoder:
            encoder = Krea2TextEncoder.from_pretrained(source, dtype=dtype, load_format="meta", **hub_kwargs)
            quantize_text_encoder(encoder.text_encoder, method)
            return encoder

        encoder = _from_snapshot(
            store, key, "text_encoder", build, lambda encoder: encoder.text_encoder, device, clock, outcomes
        )
        if encoder is not None:
            return encoder
    with clock.phase("weights", bytes, "text_encoder"):
        encoder = Krea2TextEncoder.from_pretrained(
            source, dtype=dtype, device=device, load_format=load_format, **hub_kwargs
        )
    if method is not None:
        with clock.phase("quantization"):
            quantize_text_encoder(encoder.text_encoder, method)
    if store is not None:
        _save_snapshot(store, key, "text_encoder", encoder.text_encoder, clock, outcomes)
    return encoder


def _snapshot_store(
    weight_store: str | os.PathLike | None, quantized: bool, load_format: str
) -> WeightSnapshots | None:
    """Where a component's quantised weights are kept and found: `weight_store` when the component is quantised (in a
    way a snapshot keeps) and read from its files; else None."""
    return WeightSnapshots(weight_store) if weight_store is not None and quantized and load_format == "auto" else None


def _from_snapshot(
    store: WeightSnapshots,
    key: ArtifactKey,
    name: str,
    build: Callable[[], Any],
    module_of: Callable[[Any], torch.nn.Module],
    device: torch.device,
    clock: _PhaseClock,
    outcomes: dict[str, Any],
) -> Any:
    """Component `name` from the snapshot of `key`: `build()` makes it on the meta device in its quantised structure,
    its module (`module_of`) is filled on `device`; timed as `weights`, its read kept in `clock.reads` and the
    outcome in `outcomes[name]`. None when the store has no snapshot it can use (the caller loads the files)."""
    with clock.phase("weights"):
        with torch.device("meta"):
            component = build()
        found = store.load(key, module_of(component), device)
    outcomes[name] = found.to_dict()
    if found.status != "loaded":
        return None
    clock.reads[name] = {"seconds": found.seconds, "bytes": found.bytes}
    module_of(component).eval()
    return component


def _save_snapshot(
    store: WeightSnapshots,
    key: ArtifactKey,
    name: str,
    module: torch.nn.Module,
    clock: _PhaseClock,
    outcomes: dict[str, Any],
) -> None:
    """Save `module` (component `name`, as loaded and quantised) as the snapshot of `key`, timed as
    `snapshot_save`; the outcome in `outcomes[name + "_saved"]`."""
    with clock.phase("snapshot_save"):
        outcomes[f"{name}_saved"] = store.save(key, module).to_dict()


class _PhaseClock:
    """Seconds spent per named phase, a phase's time excluding the phases nested in it (quantising a block while
    the transformer's weights are read counts as quantization, not as weights); on CUDA each phase ends once the
    device's queued work is done. A phase that reads `bytes` of component `part` is also kept in `reads`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.reads: dict[str, dict[str, float]] = {}
        self._stack: list[list] = []  # [name, start, nested seconds]

    @contextlib.contextmanager
    def phase(self, name: str, bytes: int = 0, part: str | None = None):
        self._stack.append([name, time.perf_counter(), 0.0])
        try:
            yield
        finally:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            _, start, nested = self._stack.pop()
            elapsed = time.perf_counter() - start
            self.seconds[name] = round(self.seconds.get(name, 0.0) + elapsed - nested, 3)
            if part is not None and bytes:
                self.reads[part] = {"seconds": round(elapsed - nested, 3), "bytes": bytes}
            if self._stack:
                self._stack[-1][2] += elapsed


def _weight_bytes(folder: pathlib.Path, load_format: str) -> int:
    """Bytes of a component folder's safetensors files (0 for random weights or a folder not on this machine)."""
    if load_format == "dummy" or not folder.is_dir():
        return 0
    return sum(file.stat().st_size for file in folder.glob("*.safetensors"))


def default_checkpoint(variant: str | None) -> pathlib.Path:
    """The embedded checkpoint a command loads when no model is given: the Turbo student for `variant == "turbo"`,
    else the base (`raw`, or no variant). Raises `CheckpointError` when that folder is missing."""
    if variant == "turbo":
        if not (EMBEDDED_TURBO_CHECKPOINT / "model_index.json").is_file():
            raise CheckpointError(
                f"the embedded Turbo checkpoint is missing: {EMBEDDED_TURBO_CHECKPOINT} has no model_index.json "
                "(train it with scripts/train_turbo.py), or pass --model, or use --variant raw"
            )
        return EMBEDDED_TURBO_CHECKPOINT
    return EMBEDDED_CHECKPOINT


def resolve_model(model: str | os.PathLike | None, variant: str | None) -> str | os.PathLike:
    """`model` when given, else `default_checkpoint(variant)`: what `--model` / `--variant` of the commands load."""
    return model if model is not None else default_checkpoint(variant)


def resolve_base_checkpoint(
    root: pathlib.Path, extras: dict, base: str | os.PathLike | None = None, **hub_kwargs: Any
) -> pathlib.Path | None:
    """The local folder of the base checkpoint a partial checkpoint at `root` points to (None: it names none).

    `base` (a folder, relative to the working directory, or a hub repo id), else `extras["base_checkpoint"]` from
    `dicache.json` (a folder relative to `root`, or a hub repo id). A pointer that resolves nowhere raises
    `CheckpointError` naming the checkpoint, the pointer and the folder it looked for.
    """
    pointer = base if base is not None else extras.get("base_checkpoint")
    if pointer is None:
        return None
    if not isinstance(pointer, str | os.PathLike) or not os.fspath(pointer):
        raise CheckpointError(f"{root / 'dicache.json'}: base_checkpoint={pointer!r} must be a folder or repo id")
    text = os.fspath(pointer)
    local = pathlib.Path(os.path.expanduser(text))
    if base is None and not local.is_absolute():  # the pointer in dicache.json is relative to the checkpoint
        local = root / local
    if local.is_dir():
        return local.resolve()
    if text.startswith((".", "/", "~", "\\")):  # a path, not a hub repo id
        shared = ", ".join(extras.get("shared_components") or ["its missing components"])
        raise CheckpointError(
            f"checkpoint {root} takes {shared} from its base checkpoint {text!r} (dicache.json base_checkpoint), "
            f"but {local} does not exist; put the base there or pass base=... (another folder or a hub repo id)"
        )
    try:
        return resolve_component_dir(pointer, None, **hub_kwargs)
    except CheckpointError as err:
        raise CheckpointError(
            f"checkpoint {root} needs its base checkpoint {text!r} (dicache.json base_checkpoint), "
            f"which is neither a folder at {local} nor an available hub repo: {err}"
        ) from err


def component_fingerprint(directory: str | os.PathLike) -> str:
    """sha256 over the names and bytes of a component folder's `*.safetensors` files (sorted; shards included)."""
    digest = hashlib.sha256()
    files = sorted(pathlib.Path(directory).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {directory}")
    for file in files:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def check_base_files(root: pathlib.Path, extras: dict, base_root: pathlib.Path) -> None:
    """With `extras["base_files_sha256"]` (component -> `component_fingerprint` recorded at distillation), raise
    `CheckpointError` if the base's weights differ: the student only works with the components it was trained with."""
    for component, digest in (extras.get("base_files_sha256") or {}).items():
        if (root / component).is_dir():
            continue  # this checkpoint has its own copy
        found = component_fingerprint(base_root / component)
        if found != digest:
            raise CheckpointError(
                f"checkpoint {root} was distilled with a different {component}: the weights in "
                f"{base_root / component} have sha256 {found[:12]}…, its dicache.json base_files_sha256 expects "
                f"{str(digest)[:12]}…; use the base checkpoint it was trained with"
            )


def heldout_prompts_file(model: str | os.PathLike | None) -> pathlib.Path:
    """`heldout_prompts.json` of a local checkpoint (None: the embedded one), else of its base; may not exist."""
    root = pathlib.Path(model) if model is not None else EMBEDDED_CHECKPOINT
    own = root / "heldout_prompts.json"
    if own.is_file() or not root.is_dir():
        return own
    try:
        base = resolve_base_checkpoint(root, read_dicache_json(root))
    except CheckpointError:
        return own
    return base / "heldout_prompts.json" if base is not None else own


def read_dicache_json(root: str | os.PathLike) -> dict:
    """dicache's metadata `dicache.json` of a local checkpoint folder (`{}` when it has none)."""
    return _read_optional_json(pathlib.Path(root) / "dicache.json")


def _component_listed(index: dict, name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, list | tuple) and len(entry) == 2 and entry[0] is not None and entry[1] is not None


def _read_optional_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
