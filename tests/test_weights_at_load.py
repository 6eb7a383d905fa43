"""Weights read at disk speed and quantised while they are read (issue 41): the parallel safetensors reader gives
safetensors' own tensors; a transformer quantised block by block while loading is the model quantised after loading,
and no block waits in bf16 for the others; random weights drawn part by part are the same weights."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dicache.models.krea2.checkpoints import EMBEDDED_CHECKPOINT
from dicache.models.krea2.pipeline import Krea2Pipeline
from dicache.models.krea2.transformer import Krea2Transformer
from dicache.models.loading import CheckpointError, load_state_dict_files, materialize_random
from dicache.models.tensor_files import TensorFileError, read_header, read_tensor_files
from dicache.quantization.weights import quantize_transformer

pytest.importorskip("torchao")  # INT8 runs on the CPU through torchao


def _all_dtypes() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2, generator=gen).half(),
        "i64": torch.arange(5),
        "bool": torch.tensor([True, False, True]),
        "e4m3": torch.randn(4, 4, generator=gen).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }


def test_the_reader_gives_safetensors_own_tensors(tmp_path):
    tensors = _all_dtypes()
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file({"other": torch.randn(300, 200)}, str(tmp_path / "b.safetensors"))
    read = dict(read_tensor_files([tmp_path / "a.safetensors", tmp_path / "b.safetensors"], threads=2))
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as fh:
        expected = {**tensors, "other": fh.get_tensor("other")}
    assert read.keys() == expected.keys()
    for key, tensor in expected.items():
        assert read[key].dtype == tensor.dtype and read[key].shape == tensor.shape, key
        assert torch.equal(read[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), key


def test_the_reader_casts_on_request_and_headers_are_in_data_order(tmp_path):
    save_file({"b": torch.ones(2), "a": torch.zeros(3)}, str(tmp_path / "x.safetensors"))
    entries = read_header(tmp_path / "x.safetensors")
    assert [e.start for e in entries] == sorted(e.start for e in entries)
    read = dict(read_tensor_files([tmp_path / "x.safetensors"], cast=lambda key, dtype: torch.bfloat16))
    assert read["a"].dtype == read["b"].dtype == torch.bfloat16


def test_a_truncated_or_foreign_file_is_an_error_naming_it(tmp_path):
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "w.safetensors"))
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[:-100])
    with pytest.raises(TensorFileError, match=r"short\.safetensors.*'w'.*truncated or corrupt"):
        list(read_tensor_files([tmp_path / "short.safetensors"]))
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(TensorFileError, match=r"junk\.safetensors is not a safetensors file"):
        read_header(tmp_path / "junk.safetensors")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_state_dict_files(tmp_path / "c")


def _sharded_embedded_transformer(directory: pathlib.Path) -> pathlib.Path:
    """The embedded transformer re-saved as 3 shards with an index, keys interleaved across shards."""
    source = EMBEDDED_CHECKPOINT / "transformer"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text((source / "config.json").read_text())
    with safe_open(str(source / "diffusion_pytorch_model.safetensors"), "pt") as fh:
        state = {key: fh.get_tensor(key) for key in fh.keys()}  # noqa: SIM118 - not iterable
    shards: dict[str, dict] = {}
    for i, key in enumerate(sorted(state)):
        shards.setdefault(f"diffusion_pytorch_model-0000{i % 3 + 1}-of-00003.safetensors", {})[key] = state[key]
    weight_map = {}
    for name, part in shards.items():
        save_file(part, str(directory / name))
        weight_map.update(dict.fromkeys(part, name))
    (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's weights as plain tensors (a quantised weight through its inner tensors)."""
    out = {}
    for key, value in model.state_dict().items():
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            out.update({f"{key}.{name}": getattr(value, name) for name in names})
        else:
            out[key] = value
    return out


def _record_unread(seen: list):
    """An `on_block` that records, per block handed over, which later blocks already hold their weights."""

    def record(model: Krea2Transformer, name: str) -> None:
        names = model.block_names()
        later = names[names.index(name) + 1 :]
        seen.append((name, [b for b in later if not any(p.is_meta for p in model.get_submodule(b).parameters())]))

    return record


def test_each_block_is_handed_over_before_the_later_ones_are_read(tmp_path):
    seen: list = []
    model = Krea2Transformer.from_pretrained(EMBEDDED_CHECKPOINT, on_block=_record_unread(seen))
    assert sorted(name for name, _ in seen) == sorted(model.block_names())
    assert all(read == [] for _, read in seen), seen  # no block waited, read, for the others


def test_a_sharded_checkpoint_read_in_parallel_is_the_single_file_one(tmp_path):
    directory = _sharded_embedded_transformer(tmp_path / "transformer")
    seen: list = []
    sharded = Krea2Transformer.from_pretrained(directory, subfolder=None, on_block=_record_unread(seen))
    single = Krea2Transformer.from_pretrained(EMBEDDED_CHECKPOINT)
    assert sorted(name for name, _ in seen) == sorted(single.block_names())
    a, b = sharded.state_dict(), single.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_from_pretrained_quantises_while_loading_and_reports_the_phases():
    pipe = Krea2Pipeline.from_pretrained(quantization="int8", text_encoder_quantization="fp8")
    reference = Krea2Pipeline.from_pretrained()
    reference.quantize("int8")
    reference.quantize_text_encoder("fp8")
    assert pipe.transformer.quantization == reference.transformer.quantization
    assert pipe.text_encoder_quantization == "fp8"
    pairs = [(pipe.transformer, reference.transformer)]
    pairs.append((pipe.text_encoder.text_encoder, reference.text_encoder.text_encoder))
    for got, expected in pairs:
        a, b = _state(got), _state(expected)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert set(pipe.load_timings) == {"imports", "weights", "quantization"}
    assert all(seconds >= 0 for seconds in pipe.load_timings.values())
    assert set(pipe.load_reads) == {"transformer", "text_encoder", "vae"}
    assert pipe.load_reads["transformer"]["bytes"] == sum(
        f.stat().st_size for f in (EMBEDDED_CHECKPOINT / "transformer").glob("*.safetensors")
    )


def test_random_weights_drawn_block_by_block_are_the_same_weights():
    config = json.loads((EMBEDDED_CHECKPOINT / "transformer" / "config.json").read_text())
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    whole, parts = (Krea2Transformer(**kwargs).to("meta") for _ in range(2))
    materialize_random(whole, device="cpu", dtype=torch.bfloat16)
    handed: list = []

    def on_part(model: Krea2Transformer, name: str) -> None:
        unmade = [b for b in model.block_names() if any(p.is_meta for p in model.get_submodule(b).parameters())]
        handed.append((name, unmade))

    materialize_random(parts, device="cpu", dtype=torch.bfloat16, parts=parts.block_names(), on_part=on_part)
    assert [name for name, _ in handed] == parts.block_names()
    assert handed[0][1] == parts.block_names()[1:]  # the later blocks do not exist yet when the first is handed over
    a, b = whole.state_dict(), parts.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_every_block_is_drawn_when_each_handed_block_is_quantised():
    """Quantising at load replaces a block's parameters as soon as it is handed over, freeing the drawn ones, and a
    later block's parameter may get a freed one's id. Each must still be drawn: every block, when handed over, holds
    the whole model's values (with INT8 on the CPU, 73 of the tiny model's block parameters were left undrawn when a
    recycled id counted as "drawn already"; full-size FP8 served NaN from the second block on)."""
    config = json.loads((EMBEDDED_CHECKPOINT / "transformer" / "config.json").read_text())
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    whole, parts = (Krea2Transformer(**kwargs).to("meta") for _ in range(2))
    expected = materialize_random(whole, device="cpu", dtype=torch.bfloat16).state_dict()
    undrawn: list[str] = []

    def quantize_block(model: Krea2Transformer, name: str) -> None:  # as checkpoints.load_transformer's
        state = model.get_submodule(name).state_dict()
        undrawn.extend(f"{name}.{k}" for k, v in state.items() if not torch.equal(v, expected[f"{name}.{k}"]))
        quantize_transformer(model, "int8", only=lambda linear: linear.startswith(name + "."))

    materialize_random(parts, device="cpu", dtype=torch.bfloat16, parts=parts.block_names(), on_part=quantize_block)
    assert undrawn == []
    assert type(parts.transformer_blocks[-1].attn.to_q.weight).__name__ == "Int8Tensor"  # every block quantised


def test_the_text_encoders_model_code_is_imported_on_a_thread_while_the_transformer_loads(monkeypatch):
    """transformers' model code for the text encoder is imported on its own thread, started before the transformer
    is read, and the loading waits for it before building the text encoder; the loaded model is unchanged."""
    import threading

    from dicache.models.krea2 import checkpoints

    events = []
    real_import, real_load = checkpoints._import_text_encoder_code, checkpoints.load_transformer

    def recording_import():
        events.append(("imports", threading.current_thread().name))
        real_import()

    def recording_load(*args, **kwargs):
        started = [name for kind, name in events if kind == "thread started"]
        events.append(("transformer", started))
        return real_load(*args, **kwargs)

    real_start = threading.Thread.start

    def recording_start(thread):
        events.append(("thread started", thread.name))
        real_start(thread)

    monkeypatch.setattr(checkpoints, "_import_text_encoder_code", recording_import)
    monkeypatch.setattr(checkpoints, "load_transformer", recording_load)
    monkeypatch.setattr(threading.Thread, "start", recording_start)
    pipe = Krea2Pipeline.from_pretrained(quantization="int8")
    monkeypatch.undo()
    assert ("transformer", ["dicache-text-encoder-imports"]) in events  # started before the transformer's read
    assert ("imports", "dicache-text-encoder-imports") in events
    imports = [event for event in events if event[0] == "imports"]
    assert imports[-1] == ("imports", "MainThread")  # then waited for, in place, before the text encoder is built
    reference = Krea2Pipeline.from_pretrained(quantization="int8")
    a, b = _state(pipe.text_encoder.text_encoder), _state(reference.text_encoder.text_encoder)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_with_torchao_installed_but_not_imported_the_text_encoders_code_is_imported_in_place(monkeypatch):
    """Hiding torchao on another thread would hide it from the main thread too: then no thread is started."""
    import sys

    from dicache.models.krea2 import checkpoints

    monkeypatch.delitem(sys.modules, "torchao", raising=False)
    monkeypatch.setattr(checkpoints.importlib.util, "find_spec", lambda name, *a: object())
    assert checkpoints._import_text_encoder_code_meanwhile(None) is None
