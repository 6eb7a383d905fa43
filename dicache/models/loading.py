"""Checkpoint loading shared by the native models: find a component's folder, read its JSON, load its safetensors.

A component is one folder of a diffusers-layout checkpoint (`transformer/`, `vae/`, ...) holding a `config.json` and
either one `*.safetensors` file or shards listed by a `*.safetensors.index.json`. The folder may be local or a Hugging
Face Hub repo (resolved through the local hub cache, downloading only that subfolder when allowed).

Every failure a user can cause (wrong path, offline with nothing cached, missing shard, mismatched weights) raises
`CheckpointError` with a message naming the repo or folder, the file and, for weights, the key and shapes.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from dicache.errors import DicacheError
from dicache.models.tensor_files import TensorFileError, read_header, read_tensor_files

WEIGHT_FILE_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")
_MAX_LISTED = 8  # how many offending keys an error message lists before summarising


class CheckpointError(DicacheError, RuntimeError):
    """A checkpoint cannot be found, read or loaded. The message names the repo/folder, the file and the key."""


@contextlib.contextmanager
def hidden_packages(*names: str) -> Iterator[None]:
    """Within the block, the top-level packages `names` look uninstalled (`importlib.util.find_spec` gives None,
    `import` raises `ModuleNotFoundError`), unless one is imported already; afterwards they import as usual.

    For a library that, while it is imported, imports every optional package it finds installed: transformers imports
    torchao (a quarter second and its warnings) whenever torchao is installed, though dicache never asks transformers
    to use it. The library keeps its answer (transformers caches its probes), while `dicache.quantization` still
    imports torchao itself when a quantization asks for it. Not for a block that runs while other threads import."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # the import system's mark for a module that cannot be imported
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def resolve_component_dir(
    path_or_repo_id: str | os.PathLike,
    subfolder: str | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    local_files_only: bool | None = None,
) -> pathlib.Path:
    """Return the local folder of one checkpoint component.

    A local directory resolves to itself (joined with `subfolder`). Anything else is taken as a Hub repo id and
    resolved with `huggingface_hub.snapshot_download`, fetching only `subfolder/*` into `cache_dir` (default: the
    hub cache). `local_files_only=None` follows the `HF_HUB_OFFLINE` environment variable at call time.
    """
    path = pathlib.Path(os.path.expanduser(os.fspath(path_or_repo_id)))
    if path.is_dir():
        return _require_subfolder(path, subfolder, origin=str(path))
    if path.exists():
        raise CheckpointError(f"{path} is a file; expected a checkpoint folder or a Hugging Face Hub repo id")

    repo_id = os.fspath(path_or_repo_id)
    if local_files_only is None:
        local_files_only = _env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE")
    pattern = f"{subfolder.strip('/')}/*" if subfolder else "*"
    where = f"repo '{repo_id}'" + (f", subfolder '{subfolder}'" if subfolder else "")

    # huggingface_hub's download client takes about 0.5 s to import: only a Hub id needs it
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except ValueError as err:
        raise CheckpointError(f"{repo_id!r} is neither an existing local folder nor a valid Hub repo id") from err
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=os.fspath(cache_dir) if cache_dir is not None else None,
            local_files_only=local_files_only,
            allow_patterns=[pattern],
        )
    except Exception as err:  # huggingface_hub raises many unrelated types; the cause stays chained
        reason = "offline (local_files_only / HF_HUB_OFFLINE) and not in the local cache" if local_files_only else ""
        raise CheckpointError(
            f"cannot resolve {where}: files '{pattern}' (revision {revision or 'main'}) are not available"
            + (f" - {reason}" if reason else "")
            + f" [cache_dir={cache_dir or 'default hub cache'}]. Download them first, e.g. "
            f"`hf download {repo_id} --include '{pattern}'`, or pass a local folder. Cause: {type(err).__name__}: {err}"
        ) from err
    return _require_subfolder(pathlib.Path(snapshot), subfolder, origin=f"repo '{repo_id}'")


def read_json(directory: pathlib.Path, name: str) -> dict:
    """Parse `directory/name` as a JSON object; a missing, unreadable or non-object file raises `CheckpointError`."""
    file = pathlib.Path(directory) / name
    if not file.is_file():
        raise CheckpointError(f"missing {name} in {directory} (expected file {file})")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"invalid {name} at {file}: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"invalid {name} at {file}: expected a JSON object, found {type(data).__name__}")
    return data


def default_dtype(device: torch.device | str | None) -> torch.dtype:
    """The compute dtype a model gets when none is asked for: bfloat16 on CUDA, float32 elsewhere."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.float32


LOAD_FORMATS = ("auto", "dummy")
"""`auto`: read the safetensors weights; `dummy`: random weights from the component configs alone (SGLang's
`--load-format dummy`, for speed and memory measurements without a checkpoint's weights)."""


def check_load_format(load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"load_format={load_format!r} is invalid: must be one of {', '.join(LOAD_FORMATS)}")
    return load_format


@torch.no_grad()
def materialize_random(
    module: torch.nn.Module,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    keep_fp32: Callable[[str], bool] | None = None,
    parts: Sequence[str] = (),
    on_part: Callable[[torch.nn.Module, str], None] | None = None,
) -> torch.nn.Module:
    """Give a module built on the meta device random weights on `device`, without a float32 copy of the whole.

    Floating parameters become `dtype` (float32 where `keep_fp32(name)`), are allocated on `device` and drawn there:
    matrices and kernels from N(0, 1/fan_in); the gains of normalisation layers (a module whose class name contains
    "Norm", parameter `weight` or `gamma`) their identity value: 1, or 0 for a module whose `zero_centred_gain` is
    true (its scale is `1 + weight`); other vectors (biases, tables) zero. Deterministic (seed 0). Zero gains made
    every normalised activation zero, so the model computed on zeros: faster than on real data (a GPU at its power
    limit clocks higher) and, through FP8's per-row scales, NaN.

    `parts` (submodule names, e.g. each transformer block) are allocated one at a time and each is handed to
    `on_part(module, name)` as soon as it is drawn (e.g. to quantise it before the next one exists); the values are
    the same as without `parts`.
    """
    for name, param in module.named_parameters():
        if param.is_floating_point():
            target = torch.float32 if keep_fp32 is not None and keep_fp32(name) else dtype
            param.data = param.data.to(target)
    generator = torch.Generator(device=device).manual_seed(0)
    # parameters drawn already (tied ones are drawn once), by id with a weak reference: `on_part` may free a part's
    # parameters (quantising replaces them), and a later parameter given a freed one's id must still be drawn
    done: dict[int, weakref.ref] = {}
    groups = set(parts)
    current: str | None = None
    for name, owner in module.named_modules():
        if current is not None and not name.startswith(current + "."):
            if on_part is not None:
                on_part(module, current)
            current = None
        if current is None and name in groups:
            current = name
        owner.to_empty(device=device, recurse=False)
        for param_name, param in owner.named_parameters(recurse=False):
            drawn = done.get(id(param))
            if not param.is_floating_point() or (drawn is not None and drawn() is param):
                continue
            done[id(param)] = weakref.ref(param)
            if param.dim() >= 2:
                fan_in = param[0].numel()
                param.normal_(0.0, fan_in**-0.5, generator=generator)
            elif is_norm_gain(owner, param_name):
                param.fill_(0.0 if getattr(owner, "zero_centred_gain", False) else 1.0)
            else:
                param.zero_()
    if current is not None and on_part is not None:
        on_part(module, current)
    return module


def is_norm_gain(owner: torch.nn.Module, name: str) -> bool:
    """Whether `owner.<name>` is the gain of a normalisation layer (see `materialize_random`)."""
    return "norm" in type(owner).__name__.lower() and name in ("weight", "gamma")


def load_state_dict_files(
    directory: pathlib.Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    keep_fp32: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of the safetensors checkpoint in `directory` onto `device`.

    Layouts: one `*.safetensors` file, or shards listed by a `*.safetensors.index.json` (`weight_map`: key -> shard).
    Tensors are read straight onto `device`, the shards in parallel (`tensor_files.read_tensor_files`: no host-memory
    copy of the model). Floating tensors are cast to `dtype` (None: keep the stored dtype); keys for which
    `keep_fp32(key)` is true become float32.
    """
    directory = pathlib.Path(directory)
    files = _weight_files(directory)
    _check_shards(directory, files)
    return dict(_read_tensors(files, device, dtype, keep_fp32))


def _check_shards(directory: pathlib.Path, files: list[tuple[pathlib.Path, list[str]]]) -> dict[str, tuple]:
    """Every shard's keys against its index entry and against the other shards (from the headers alone); returns
    {key: shape} of the whole checkpoint."""
    shapes: dict[str, tuple] = {}
    for file, expected_keys in files:
        try:
            entries = read_header(file)
        except (TensorFileError, OSError) as err:
            raise CheckpointError(f"cannot read {file}: {err}") from err
        found = {e.key: e.shape for e in entries}
        missing = sorted(set(expected_keys) - found.keys())
        if missing:
            raise CheckpointError(
                f"shard {file} lacks {len(missing)} key(s) its index lists, e.g. {_listing(missing)}"
                f" (index in {directory})"
            )
        duplicates = sorted(found.keys() & shapes.keys())
        if duplicates:
            raise CheckpointError(f"key(s) {_listing(duplicates)} appear in more than one shard in {directory}")
        shapes.update(found)
    return shapes


def _read_tensors(
    files: list[tuple[pathlib.Path, list[str]]],
    device: torch.device | str,
    dtype: torch.dtype | None,
    keep_fp32: Callable[[str], bool] | None,
):
    def cast(key: str, stored: torch.dtype) -> torch.dtype | None:
        return torch.float32 if keep_fp32 is not None and keep_fp32(key) else dtype

    try:
        yield from read_tensor_files([file for file, _ in files], device, cast)
    except (TensorFileError, OSError) as err:
        raise CheckpointError(f"cannot read the checkpoint: {err}") from err


def load_into_module(
    module: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    *,
    source: str,
    ignore_prefixes: tuple[str, ...] = (),
) -> None:
    """Strictly load `state_dict` into `module`, taking ownership of its tensors (`assign=True`).

    Every key of `module.state_dict()` must be present with the same shape, and no other key may appear except
    those starting with one of `ignore_prefixes`; otherwise `CheckpointError` names each key, the expected and the
    found shape, and `source`. A module built on the meta device receives the loaded tensors without a copy.
    """
    state_dict = (
        {k: v for k, v in state_dict.items() if not k.startswith(ignore_prefixes)} if ignore_prefixes else state_dict
    )
    check_keys(module, {key: tuple(t.shape) for key, t in state_dict.items()}, source)
    module.load_state_dict(state_dict, strict=True, assign=True)
    _check_nothing_on_meta(module, source)


def check_keys(module: torch.nn.Module, shapes: dict[str, tuple], source: str) -> None:
    """`CheckpointError` unless the checkpoint's keys and shapes (`shapes`) are exactly `module`'s state dict's."""
    expected = module.state_dict(keep_vars=True)
    problems = []
    unknown = sorted(shapes.keys() - expected.keys())
    if unknown:
        problems.append(f"unknown key(s) not in {type(module).__name__}: {_listing(unknown)}")
    missing = sorted(expected.keys() - shapes.keys())
    if missing:
        problems.append(f"missing key(s): {_listing(missing)}")
    mismatched = [
        f"{key} (expected {tuple(expected[key].shape)}, found {tuple(shapes[key])})"
        for key in sorted(expected.keys() & shapes.keys())
        if tuple(expected[key].shape) != tuple(shapes[key])
    ]
    if mismatched:
        problems.append(f"wrong shape: {_listing(mismatched)}")
    if problems:
        raise CheckpointError(f"checkpoint {source} does not match {type(module).__name__}: " + "; ".join(problems))


def _check_nothing_on_meta(module: torch.nn.Module, source: str) -> None:
    still_meta = [name for name, t in _named_tensors(module) if t.is_meta]
    if still_meta:
        raise CheckpointError(
            f"after loading {source}, {type(module).__name__} still has tensors on the meta device "
            f"(not stored in the checkpoint): {_listing(still_meta)}"
        )


def load_streamed(
    module: torch.nn.Module,
    directory: pathlib.Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None,
    keep_fp32: Callable[[str], bool] | None = None,
    parts: Sequence[str] = (),
    on_part: Callable[[torch.nn.Module, str], None] | None = None,
) -> None:
    """Fill `module` (built on the meta device) with the checkpoint in `directory` as it is read: keys and shapes
    are checked against the module from the files' headers first (`check_keys`), then each tensor is placed as soon
    as it arrives (`load_state_dict_files`' reading, parallel over shards). Each submodule named in `parts` is
    handed to `on_part(module, name)` once all of its weights are in place, while the rest is still being read; so
    at most the parts in flight exist in the checkpoint's precision besides what `on_part` made of the others."""
    files = _weight_files(directory)
    check_keys(module, _check_shards(directory, files), str(directory))
    owner: dict[str, str] = {}
    needed: dict[str, int] = {}
    expected = module.state_dict(keep_vars=True)
    for part in parts:
        keys = [key for key in expected if key.startswith(part + ".")]
        owner.update(dict.fromkeys(keys, part))
        needed[part] = len(keys)
    pending: dict[str, dict[str, torch.Tensor]] = {part: {} for part in parts}
    rest: dict[str, torch.Tensor] = {}
    for key, tensor in _read_tensors(files, device, dtype, keep_fp32):
        part = owner.get(key)
        if part is None:
            rest[key] = tensor
            continue
        pending[part][key[len(part) + 1 :]] = tensor
        if len(pending[part]) == needed[part]:
            module.get_submodule(part).load_state_dict(pending.pop(part), strict=True, assign=True)
            if on_part is not None:
                on_part(module, part)
    for part in [p for p, tensors in pending.items() if needed[p] == 0]:  # a part without weights
        pending.pop(part)
        if on_part is not None:
            on_part(module, part)
    module.load_state_dict(rest, strict=False, assign=True)
    _check_nothing_on_meta(module, str(directory))


def load_component(
    path_or_repo_id: str | os.PathLike,
    subfolder: str | None,
    build: Callable[[dict, pathlib.Path], torch.nn.Module],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    load_format: str = "auto",
    keep_fp32: Callable[[str], bool] | None = None,
    load_weights: Callable[[torch.nn.Module, dict[str, torch.Tensor], str], None] | None = None,
    parts: Sequence[str] | Callable[[torch.nn.Module], Sequence[str]] = (),
    on_part: Callable[[torch.nn.Module, str], None] | None = None,
    **hub_kwargs,
) -> torch.nn.Module:
    """Build one component from its folder's `config.json` and fill it with its safetensors weights; eval mode.

    `build(config, directory)` makes the module from the parsed `config.json` (it runs on the meta device and raises
    `CheckpointError` for a bad config). The weights are then read straight onto `device` (default CPU) as `dtype`
    (default: `default_dtype(device)`), float32 where `keep_fp32(key)`, and placed as they arrive (`load_streamed`),
    or, with `load_weights`, given whole to `load_weights(module, state_dict, source)`. `parts` / `on_part`: each
    submodule named in `parts` (or in `parts(module)`) is handed to `on_part(module, name)` as soon as its weights
    are in place (not with `load_weights`). `load_format="dummy"`: random weights instead (`materialize_random`,
    part by part too). `hub_kwargs` go to `resolve_component_dir`.
    """
    directory = resolve_component_dir(path_or_repo_id, subfolder, **hub_kwargs)
    device = torch.device(device if device is not None else "cpu")
    dtype = dtype if dtype is not None else default_dtype(device)
    config = read_json(directory, "config.json")
    with torch.device("meta"):
        model = build(config, directory)
    if callable(parts):
        parts = parts(model)
    if check_load_format(load_format) == "dummy":
        materialize_random(model, device=device, dtype=dtype, keep_fp32=keep_fp32, parts=parts, on_part=on_part)
        return model.eval()
    if load_weights is None:
        load_streamed(model, directory, device=device, dtype=dtype, keep_fp32=keep_fp32, parts=parts, on_part=on_part)
    else:
        if parts:
            raise ValueError("load_component: parts / on_part need the default load_weights")
        load_weights(
            model, load_state_dict_files(directory, device=device, dtype=dtype, keep_fp32=keep_fp32), str(directory)
        )
    return model.eval()


def _require_subfolder(root: pathlib.Path, subfolder: str | None, *, origin: str) -> pathlib.Path:
    if not subfolder:
        return root
    directory = root / subfolder
    if not directory.is_dir():
        raise CheckpointError(
            f"{origin} has no subfolder '{subfolder}' (looked for {directory}); pass subfolder=None if the folder is "
            "the component itself"
        )
    return directory


def _weight_files(directory: pathlib.Path) -> list[tuple[pathlib.Path, list[str]]]:
    """The safetensors files of `directory` with the keys each one must hold (empty list: no index to check)."""
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint folder {directory} does not exist")
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        names = ", ".join(i.name for i in indexes)
        raise CheckpointError(f"ambiguous checkpoint in {directory}: several index files ({names})")
    if indexes:
        index = indexes[0]
        weight_map = read_json(directory, index.name).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"invalid {index.name} in {directory}: no 'weight_map' object")
        keys_by_shard: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            keys_by_shard.setdefault(shard, []).append(key)
        files = []
        for shard, keys in keys_by_shard.items():
            file = directory / shard
            if not file.is_file():
                raise CheckpointError(f"missing shard {shard} (listed in {index.name}) in {directory}")
            files.append((file, keys))
        return files

    for name in WEIGHT_FILE_NAMES:
        if (directory / name).is_file():
            return [(directory / name, [])]
    candidates = sorted(directory.glob("*.safetensors"))
    if len(candidates) == 1:
        return [(candidates[0], [])]
    if candidates:
        names = ", ".join(c.name for c in candidates)
        raise CheckpointError(f"ambiguous checkpoint in {directory}: several .safetensors files ({names}) and no index")
    other = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f"; found {', '.join(other)} (only safetensors is supported)" if other else ""
    raise CheckpointError(
        f"no weights in {directory}: expected {' or '.join(WEIGHT_FILE_NAMES)} or a *.safetensors.index.json{hint}"
    )


def _named_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f", ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
