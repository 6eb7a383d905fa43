"""Checkpoint loading: folder resolution (local and hub cache), JSON, single/sharded safetensors, strict loading."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dicache.models.loading import (
    CheckpointError,
    default_dtype,
    load_component,
    load_into_module,
    load_state_dict_files,
    read_json,
    resolve_component_dir,
)


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


def random_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "proj.weight": torch.randn(3, 4, generator=gen),
        "proj.bias": torch.randn(3, generator=gen),
        "norm.weight": torch.randn(3, generator=gen),
        "norm.bias": torch.randn(3, generator=gen),
        "steps": torch.tensor([3, 7]),
    }


def write_sharded(directory: pathlib.Path, state: dict[str, torch.Tensor]) -> None:
    """Two shards plus a diffusers-style index (`weight_map`: key -> shard file)."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    weight_map = {}
    for shard, shard_keys in shards.items():
        save_file({k: state[k].contiguous() for k in shard_keys}, str(directory / shard))
        weight_map.update(dict.fromkeys(shard_keys, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))


def test_single_file_local_dir_loads_and_casts(tmp_path):
    state = random_state()
    save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"width": 3}))

    directory = resolve_component_dir(tmp_path)
    assert directory == tmp_path
    assert read_json(directory, "config.json") == {"width": 3}

    loaded = load_state_dict_files(directory, dtype=torch.bfloat16, keep_fp32=lambda key: key.startswith("norm."))
    assert loaded["proj.weight"].dtype == torch.bfloat16
    assert loaded["norm.weight"].dtype == torch.float32
    assert loaded["steps"].dtype == torch.int64  # integer tensors are never cast
    torch.testing.assert_close(loaded["proj.weight"], state["proj.weight"].bfloat16())

    with torch.device("meta"):
        module = TwoLayer()
    load_into_module(module, load_state_dict_files(directory), source=str(directory))
    assert not any(p.is_meta for p in module.parameters())
    torch.testing.assert_close(module.proj.bias, state["proj.bias"])
    assert module.steps.tolist() == [3, 7]


def test_sharded_with_index_and_subfolder(tmp_path):
    state = random_state()
    write_sharded(tmp_path / "component", state)
    directory = resolve_component_dir(tmp_path, subfolder="component")
    assert directory == tmp_path / "component"
    loaded = load_state_dict_files(directory)
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(loaded[key], value)


def test_missing_shard_names_shard_and_index(tmp_path):
    write_sharded(tmp_path, random_state())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*safetensors\.index\.json"):
        load_state_dict_files(tmp_path)


def test_index_key_absent_from_its_shard(tmp_path):
    state = random_state()
    write_sharded(tmp_path, state)
    index_file = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["extra.weight"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors lacks .*extra\.weight"):
        load_state_dict_files(tmp_path)


def test_no_weights_and_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"no weights in .*diffusion_pytorch_model\.safetensors"):
        load_state_dict_files(tmp_path)
    with pytest.raises(CheckpointError, match=r"missing config\.json"):
        read_json(tmp_path, "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"invalid config\.json"):
        read_json(tmp_path, "config.json")


def test_missing_local_subfolder(tmp_path):
    with pytest.raises(CheckpointError, match=r"no subfolder 'transformer'"):
        resolve_component_dir(tmp_path, "transformer")


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (lambda s: s.update({"proj.weight": torch.zeros(3, 5)}), r"proj\.weight \(expected \(3, 4\), found \(3, 5\)\)"),
        (lambda s: s.update({"head.weight": torch.zeros(1)}), r"unknown key\(s\).*head\.weight"),
        (lambda s: s.pop("norm.bias"), r"missing key\(s\): norm\.bias"),
    ],
    ids=["wrong_shape", "unknown_key", "missing_key"],
)
def test_strict_loading_errors_name_key_shapes_and_source(edit, pattern):
    state = random_state()
    edit(state)
    with torch.device("meta"):
        module = TwoLayer()
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_into_module(module, state, source="/ckpt/vae")
    assert "/ckpt/vae" in str(info.value)


def test_ignore_prefixes_drops_extra_keys():
    state = random_state()
    state["head.weight"] = torch.zeros(1)
    module = TwoLayer()
    load_into_module(module, state, source="x", ignore_prefixes=("head.",))
    torch.testing.assert_close(module.norm.weight, state["norm.weight"])


def test_hub_repo_offline_without_cache_names_repo_subfolder_and_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as info:
        resolve_component_dir("krea/krea-2-turbo", "transformer", cache_dir=tmp_path / "empty-cache")
    message = str(info.value)
    assert "krea/krea-2-turbo" in message
    assert "subfolder 'transformer'" in message
    assert "transformer/*" in message
    assert "offline" in message


def test_hub_cache_layout_resolves_with_local_files_only(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--krea--krea-2-turbo"
    component = repo_dir / "snapshots" / commit / "transformer"
    write_sharded(component, random_state())
    (component / "config.json").write_text(json.dumps({"num_layers": 2}))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)

    directory = resolve_component_dir(
        "krea/krea-2-turbo", "transformer", cache_dir=tmp_path / "hub", local_files_only=True
    )
    assert directory == component
    assert read_json(directory, "config.json") == {"num_layers": 2}
    assert load_state_dict_files(directory).keys() == random_state().keys()

    with pytest.raises(CheckpointError, match=r"repo 'krea/krea-2-turbo' has no subfolder 'vae'"):
        resolve_component_dir("krea/krea-2-turbo", "vae", cache_dir=tmp_path / "hub", local_files_only=True)


def test_invalid_path_is_neither_folder_nor_repo(tmp_path):
    with pytest.raises(CheckpointError, match=r"neither an existing local folder nor a valid Hub repo id"):
        resolve_component_dir(tmp_path / "does" / "not" / "exist")


def test_default_dtype():
    assert default_dtype("cpu") == torch.float32
    assert default_dtype(None) == torch.float32
    assert default_dtype(torch.device("cuda", 0)) == torch.bfloat16


def test_load_component_builds_from_config_loads_weights_or_draws_them(tmp_path):
    state = random_state()
    save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"width": 3}))
    seen = []

    def build(config, directory):
        seen.append((config, directory))
        return TwoLayer()

    model = load_component(tmp_path, None, build, dtype=torch.bfloat16, keep_fp32=lambda key: key.startswith("norm."))
    assert seen == [({"width": 3}, tmp_path)] and not model.training
    assert (model.proj.weight.dtype, model.norm.weight.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(model.proj.bias, state["proj.bias"].bfloat16())

    calls = []
    load_component(tmp_path, None, build, load_weights=lambda m, sd, source: calls.append((sorted(sd), source)))
    assert calls == [(sorted(state), str(tmp_path))]

    dummy = load_component(tmp_path, None, build, load_format="dummy")
    assert not any(p.is_meta for p in dummy.parameters()) and dummy.proj.weight.dtype == torch.float32
    with pytest.raises(CheckpointError, match=r"load_format='fast' is invalid"):
        load_component(tmp_path, None, build, load_format="fast")


def test_lazy_package_exports_import_on_first_use():
    import dicache.models.krea2 as krea2
    from dicache.models.krea2.scheduler import FlowMatchEulerScheduler

    assert krea2.FlowMatchEulerScheduler is FlowMatchEulerScheduler
    with pytest.raises(AttributeError, match=r"module 'dicache.models.krea2' has no attribute 'Nope'"):
        krea2.Nope  # noqa: B018
