"""The quantised transformer kept beside the compile artifact (`dicache.models.weight_snapshot`, `--artifact-weights`):
a first load quantises and saves it, a later one reads it without quantising and gives the same weights and images;
another checkpoint or quantisation, a truncated or altered shard, a corrupt manifest and a read-only store each give
one log line and a normal, quantised load. INT8 on the CPU (torchao's INT8 runs there); FP8 on a GPU (`-m gpu`)."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import pytest
import torch

from dicache.models.krea2 import Krea2Pipeline
from dicache.models.krea2.checkpoints import EMBEDDED_CHECKPOINT
from dicache.models.weight_snapshot import (
    PREFIX,
    WeightSnapshots,
    checkpoint_fingerprint,
    fingerprint,
    flatten,
    module_tensors,
)
from dicache.quantization import QuantizationSpec

pytest.importorskip("torchao")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]
LOGGER = "dicache.models.weight_snapshot"


def _load(store, *, source=None, quantization="int8", device="cpu") -> Krea2Pipeline:
    return Krea2Pipeline.from_pretrained(source, device=device, quantization=quantization, weight_store=store)


def _image(pipe: Krea2Pipeline) -> torch.Tensor:
    out = pipe("a red fox", num_inference_steps=3, height=32, width=32, seed=0, output_type="pt")
    return out.images.cpu()


def _weights(pipe: Krea2Pipeline) -> dict[str, tuple]:
    """Each weight's stored tensors (a quantised weight's qdata and scale, a plain tensor itself) and its type."""
    found = {}
    for key, tensor in pipe.transformer.state_dict().items():
        parts = [getattr(tensor, name) for name in getattr(tensor, "tensor_data_names", ())] or [tensor]
        found[key] = (type(tensor).__name__, [p.detach().cpu() for p in parts])
    return found


def _same_weights(a: Krea2Pipeline, b: Krea2Pipeline) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(
        wa[k][0] == wb[k][0] and all(torch.equal(x, y) for x, y in zip(wa[k][1], wb[k][1])) for k in wa
    )


def _metadata(pipe: Krea2Pipeline) -> dict[str, tuple]:
    """What torch.compile's caches key a graph's parameters on: each one's type, dtype, shape, strides and whether
    it requires grad (a snapshot that changed one would miss every graph compiled without it)."""
    return {
        name: (type(t).__name__, t.dtype, tuple(t.shape), t.stride(), t.requires_grad)
        for name, t in pipe.transformer.named_parameters()
    }


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.fixture(scope="module")
def reference():
    """The embedded checkpoint quantised to INT8 at load, no store."""
    pipe = _load(None)
    return pipe, _image(pipe)


def test_a_saved_snapshot_loads_without_quantising_and_gives_the_same_weights_and_images(tmp_path, reference, caplog):
    pipe, image = reference
    first = _load(tmp_path)
    assert first.weight_snapshots["transformer"]["status"] == "absent"
    assert first.weight_snapshots["transformer_saved"]["status"] == "saved"
    assert "quantization" in first.load_timings
    (folder,) = tmp_path.glob(f"{PREFIX}*")
    shards = sorted(folder.glob("*.safetensors"))
    assert first.weight_snapshots["transformer_saved"]["bytes"] == sum(s.stat().st_size for s in shards)
    parts = list(flatten(module_tensors(first.transformer)))  # the quantised model's own bytes: INT8 where it is
    stored = sum(t.numel() * t.element_size() for _, t, _ in parts)
    assert stored <= sum(s.stat().st_size for s in shards) < stored * 1.02  # beside them, the headers alone
    assert {t.dtype for _, t, _ in parts} >= {torch.int8} and any(rebuild for _, _, rebuild in parts)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        second = _load(tmp_path)
    assert second.weight_snapshots == {"transformer": second.weight_snapshots["transformer"]}  # nothing saved again
    assert second.weight_snapshots["transformer"]["status"] == "loaded"
    assert "quantization" not in second.load_timings
    assert second.load_reads["transformer"]["bytes"] == first.weight_snapshots["transformer_saved"]["bytes"]
    assert second.transformer.quantization == QuantizationSpec("int8")
    assert _same_weights(second, pipe) and _same_weights(first, pipe)
    assert _metadata(second) == _metadata(pipe) == _metadata(first)
    assert not any(p.is_meta for p in second.transformer.parameters())
    assert torch.equal(_image(second), image) and torch.equal(_image(first), image)
    assert _warnings(caplog) == []


def test_another_quantisation_or_an_altered_checkpoint_is_another_key(tmp_path, reference, caplog):
    store = tmp_path / "store"
    _load(store)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        other = _load(store, quantization=QuantizationSpec("int8", exclude=("attn_out",)))
    assert other.weight_snapshots["transformer"]["status"] == "mismatch"
    assert "differs in: quantization" in other.weight_snapshots["transformer"]["message"]
    assert other.weight_snapshots["transformer_saved"]["status"] == "saved"  # beside the first: two keys, two folders
    assert len(list(store.glob(f"{PREFIX}*"))) == 2

    altered = tmp_path / "altered"
    shutil.copytree(EMBEDDED_CHECKPOINT, altered)
    weights = altered / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    for i in (len(data) // 2, len(data) // 2 + 1):  # one weight's exponent (bf16: 2 bytes), as retraining would
        data[i] ^= 0x3C
    weights.write_bytes(bytes(data))
    assert fingerprint(weights) != checkpoint_fingerprint(EMBEDDED_CHECKPOINT / "transformer")[weights.name]
    changed = _load(store, source=altered)
    assert changed.weight_snapshots["transformer"]["status"] == "mismatch"
    assert "differs in: checkpoint" in changed.weight_snapshots["transformer"]["message"]
    assert not _same_weights(changed, reference[0])  # its own weights, not the first checkpoint's snapshot


@pytest.mark.parametrize("damage", ["truncated", "altered", "manifest"])
def test_a_damaged_snapshot_is_one_line_and_a_normal_load(tmp_path, reference, caplog, damage):
    _load(tmp_path)
    (folder,) = tmp_path.glob(f"{PREFIX}*")
    shard = next(folder.glob("*.safetensors"))
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "altered":
        data = bytearray(shard.read_bytes())
        data[-10] ^= 0xFF  # the last sampled stretch
        shard.write_bytes(bytes(data))
    else:
        (folder / "manifest.json").write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        pipe = _load(tmp_path)
    outcome = pipe.weight_snapshots["transformer"]
    assert outcome["status"] == "unreadable", outcome
    assert pipe.weight_snapshots["transformer_saved"]["status"] == "saved"  # a good one replaces it
    (warning,) = _warnings(caplog)
    assert "quantising at load" in warning
    assert _same_weights(pipe, reference[0]) and torch.equal(_image(pipe), reference[1])
    assert _load(tmp_path).weight_snapshots["transformer"]["status"] == "loaded"


def test_a_read_only_store_is_one_line_and_serving_goes_on(reference, caplog):
    store = pathlib.Path("/sys/dicache-weight-snapshots")  # sysfs: read-only even for root
    with caplog.at_level(logging.INFO, logger=LOGGER):
        pipe = _load(store)
    assert pipe.weight_snapshots["transformer"]["status"] == "absent"
    assert pipe.weight_snapshots["transformer_saved"]["status"] == "not_saved"
    (warning,) = _warnings(caplog)
    assert "cannot write it" in warning
    assert _same_weights(pipe, reference[0])


def test_the_fp8_stored_text_encoder_round_trips_with_its_unsaved_buffers(tmp_path):
    """The text encoder with FP8-stored linears (`--text-encoder-quantization fp8`, any device): saved by the first
    load, read by the second into a model built on the meta device (its rotary frequencies, which a state dict leaves
    out, come from the snapshot too), with the same tensors and the same prompt embeddings."""
    first = Krea2Pipeline.from_pretrained(text_encoder_quantization="fp8", weight_store=tmp_path)
    assert first.weight_snapshots["text_encoder_saved"]["status"] == "saved"
    assert "transformer" not in first.weight_snapshots  # not quantised: read from its checkpoint as ever
    second = Krea2Pipeline.from_pretrained(text_encoder_quantization="fp8", weight_store=tmp_path)
    assert second.weight_snapshots["text_encoder"]["status"] == "loaded"
    assert "quantization" not in second.load_timings
    a, b = (dict(p.text_encoder.text_encoder.named_buffers()) for p in (first, second))
    assert a.keys() == b.keys() and any("inv_freq" in k for k in a)  # a buffer no state dict holds
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    ea, eb = (p.encode_prompt(["a red fox", "a lighthouse at dusk"]) for p in (first, second))
    assert torch.equal(ea[0], eb[0]) and torch.equal(ea[1], eb[1])


def test_nothing_is_kept_without_quantisation_and_the_key_names_its_fields(tmp_path):
    pipe = Krea2Pipeline.from_pretrained(weight_store=tmp_path)
    assert pipe.weight_snapshots == {} and list(tmp_path.iterdir()) == []
    store = WeightSnapshots(tmp_path)
    from dicache.models.weight_snapshot import snapshot_key

    key = snapshot_key(
        "transformer", EMBEDDED_CHECKPOINT / "transformer", repr(QuantizationSpec("int8")), torch.float32
    )
    assert set(key.fields) == {
        "component",
        "checkpoint",
        "quantization",
        "dtype",
        "torch",
        "torchao",
        "dicache",
        "format",
    }
    assert json.loads(key.fields["checkpoint"]).keys() == {"config.json", "diffusion_pytorch_model.safetensors"}
    assert store.folder(key).name == PREFIX + key.digest[:16]


def test_the_commands_keep_weights_only_with_compile_quantization_and_the_switch(tmp_path):
    from dicache.cli import build_parser
    from dicache.commands.serve import parse_serve_argv
    from dicache.commands.speed import weight_store

    def store(*flags: str):
        generate = build_parser().parse_args(["generate", "x", "--compile-artifact", str(tmp_path), *flags])
        serve = parse_serve_argv(["--compile-artifact", str(tmp_path), *flags])
        assert weight_store(generate) == weight_store(serve)
        return weight_store(serve)

    assert store("--compile", "--quantization", "int8") == tmp_path
    assert store("--compile", "--quantization", "int8", "--artifact-weights", "false") is None
    assert store("--quantization", "int8") is None  # no --compile: no artifact store at all
    assert store("--compile") is None  # nothing quantised: the checkpoint is what is read
    assert store("--compile", "--text-encoder-quantization", "fp8") == tmp_path  # the text encoder's kept alone


def test_a_ray_replica_keeps_weights_like_the_single_process_server(tmp_path):
    from dicache.server.ray.spec import ReplicaSpec

    spec = QuantizationSpec("int8")
    assert ReplicaSpec(compile=True, quantization=spec, compile_artifact=str(tmp_path)).weight_store() == tmp_path
    assert (
        ReplicaSpec(compile=True, quantization=spec, compile_artifact=str(tmp_path), tp_size=2).weight_store() is None
    )
    assert ReplicaSpec(compile=True, compile_artifact=str(tmp_path)).weight_store() is None


def test_torchaos_fp8_weights_and_their_settings_round_trip_on_the_cpu(tmp_path):
    """The FP8 path's tensors without a GPU: torchao's `Float8Tensor` as dicache's FP8 linears hold it (per-row
    scales, the activation floor, fast accumulation), built directly (torchao quantises FP8 only on capable GPUs),
    saved and read back into a linear built on the meta device: the same bytes, scales and settings."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8Tensor, PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs

    from dicache.models.compile_artifact import ArtifactKey
    from dicache.quantization import FP8_ACTIVATION_FLOOR

    mm = Float8MMConfig(use_fast_accum=True)
    activations = QuantizeTensorToFloat8Kwargs(granularity=PerRow(), mm_config=mm, hp_value_lb=FP8_ACTIVATION_FLOOR)
    linear = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    weight = Float8Tensor.from_hp(
        linear.weight.detach(), granularity=PerRow(), mm_config=mm, act_quant_kwargs=activations
    )
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    store, key = WeightSnapshots(tmp_path), ArtifactKey({"component": "linear"})
    assert store.save(key, linear).status == "saved"
    with torch.device("meta"):
        empty = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    assert store.load(key, empty, "cpu").status == "loaded"
    back = empty.weight
    assert type(back) is Float8Tensor and not back.requires_grad
    assert torch.equal(back.qdata.view(torch.uint8), weight.qdata.view(torch.uint8))
    assert torch.equal(back.scale, weight.scale) and back.qdata.stride() == weight.qdata.stride()
    assert back.act_quant_kwargs == activations and back.mm_config == mm and back.block_size == weight.block_size
    assert torch.equal(empty.bias, linear.bias)


@pytest.mark.gpu
def test_the_fp8_transformer_round_trips_through_a_snapshot_on_the_gpu(tmp_path):
    """torchao's FP8 tensors (with dicache's activation floor) rebuilt from the snapshot: the same FP8 weights and
    scales, the same image, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with FP8")
    first = _load(tmp_path, quantization="fp8", device="cuda")
    second = _load(tmp_path, quantization="fp8", device="cuda")
    assert second.weight_snapshots["transformer"]["status"] == "loaded"
    assert _same_weights(first, second)
    kinds = {kind for kind, _ in _weights(second).values()}
    assert "Float8Tensor" in kinds
    assert torch.equal(_image(first), _image(second))
