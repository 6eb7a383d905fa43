"""The text encoder replayed from CUDA graphs on a GPU (`pipe.compile()`): the eager forward's bits, one capture per
batch size, fresh outputs, several threads and streams at once, recapture after quantisation. `pytest -m gpu`."""

from __future__ import annotations

import threading

import pytest
import torch

from dicache.models.krea2 import Krea2Pipeline
from dicache.models.krea2.checkpoints import EMBEDDED_CHECKPOINT
from dicache.models.krea2.text import Krea2TextEncoder
from dicache.models.static_graphs import StaticGraphs
from dicache.quantization import quantize_text_encoder
from dicache.quantization.fp8_storage import Float8StoredLinear, compile_stored_linears

pytestmark = pytest.mark.gpu


def _stored_linears(encoder):
    return [m for m in encoder.text_encoder.modules() if isinstance(m, Float8StoredLinear)]


PROMPTS = ["a red apple", "a grinning face in the rain", "two kites over a grey sea, one of them torn", ""]


def test_replayed_encoder_gives_the_eager_bits_with_one_capture_per_batch_size():
    encoder = Krea2TextEncoder.from_pretrained(EMBEDDED_CHECKPOINT, device="cuda")
    eager = {p: encoder.encode([p])[0] for p in PROMPTS}
    eager_pair = encoder.encode(PROMPTS[:2])[0]
    encoder.use_cuda_graphs()
    first = encoder.encode([PROMPTS[0]])[0]
    replayed = {p: encoder.encode([p])[0] for p in PROMPTS}
    assert encoder._graphs.captures == 1
    assert torch.equal(first, eager[PROMPTS[0]])  # a later replay did not overwrite an earlier result
    for prompt in PROMPTS:
        assert torch.equal(replayed[prompt], eager[prompt]), prompt
    assert torch.equal(encoder.encode(PROMPTS[:2])[0], eager_pair)
    assert encoder._graphs.captures == 2 and encoder._graphs.num_graphs == 2


def test_threads_on_their_own_streams_get_their_own_prompts():
    encoder = Krea2TextEncoder.from_pretrained(EMBEDDED_CHECKPOINT, device="cuda")
    eager = {p: encoder.encode([p])[0] for p in PROMPTS}
    encoder.use_cuda_graphs()
    encoder.encode([PROMPTS[0]])  # captured before the threads start
    results: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for i in range(20):
                    results[worker, i] = encoder.encode([PROMPTS[(worker + i) % len(PROMPTS)]])[0]
            stream.synchronize()
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for (worker, i), hidden in results.items():
        assert torch.equal(hidden, eager[PROMPTS[(worker + i) % len(PROMPTS)]]), (worker, i)
    assert encoder._graphs.captures == 1


def test_compiled_fp8_storage_replays_the_eager_bits():
    encoder = Krea2TextEncoder.from_pretrained(EMBEDDED_CHECKPOINT, device="cuda")
    quantize_text_encoder(encoder.text_encoder, "fp8")
    eager = {p: encoder.encode([p])[0] for p in PROMPTS}
    assert encoder.compile() == len(_stored_linears(encoder)) > 0
    for prompt in PROMPTS:
        assert torch.equal(encoder.encode([prompt])[0], eager[prompt]), prompt
    assert encoder._graphs.captures == 1
    # a full-size layer's shape (Qwen3-VL-4B's MLP), through inductor's conversion kernel: the eager bits
    layer = Float8StoredLinear.from_linear(torch.nn.Linear(2560, 9728, bias=False, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1, 300, 2560, device="cuda", dtype=torch.bfloat16)
    eager_out = layer(x)
    compile_stored_linears(layer)
    assert torch.equal(layer(x), eager_out)


def test_quantising_after_the_capture_recaptures():
    pytest.importorskip("torchao")
    pipe = Krea2Pipeline.from_pretrained(device="cuda")
    pipe.compile(vae=False)
    assert pipe.text_encoder.cuda_graphs
    pipe.text_encoder.encode(["a red apple"])
    assert pipe.text_encoder._graphs.captures == 1
    pipe.quantize_text_encoder("fp8")
    replayed = pipe.text_encoder.encode(["a red apple"])[0]
    assert pipe.text_encoder._graphs.captures == 2
    pipe.text_encoder.use_cuda_graphs(False)
    assert torch.equal(replayed, pipe.text_encoder.encode(["a red apple"])[0])


def test_static_graphs_replay_a_function_without_its_launches():
    weight = torch.randn(64, 64, device="cuda")

    def layers(x):
        for _ in range(50):
            x = torch.tanh(x @ weight)
        return x

    graphs = StaticGraphs(layers, weights=lambda: (weight,))
    x = torch.randn(8, 64, device="cuda")
    assert torch.equal(graphs(x), layers(x))
    assert graphs(x * 2).shape == (8, 64) and graphs.captures == 1
    assert torch.equal(graphs(x * 2), layers(x * 2))


def test_text_conditioning_from_the_host_mask_does_not_wait_for_the_encoder():
    """`encode_prompt` hands the mask over on the host, so packing the real tokens queues its indices behind the
    still-running encoder instead of synchronising (torch's sync debug mode turns any synchronisation into an
    error); the conditioning equals the one packed from the mask on the device."""
    pipe = Krea2Pipeline.from_pretrained(device="cuda")
    embeds, host_mask = pipe.encode_prompt(["a red apple", "a grinning face in the rain"])
    assert host_mask.device.type == "cpu" and embeds.device.type == "cuda"
    reference = pipe.transformer.encode_text(embeds, host_mask.cuda())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = pipe.transformer.encode_text(embeds, host_mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(packed.tokens, reference.tokens) and torch.equal(packed.key_mask, reference.key_mask)
    single = pipe.text_conditioning(*pipe.encode_prompt(["a red apple"]), 1)
    assert single.key_mask is None and single.tokens.device.type == "cuda"


def test_a_function_that_synchronises_runs_eagerly_after_one_failed_capture(caplog):
    def synchronising(x):
        return x * float(x.sum().item())  # .item() waits for the device: not capturable

    graphs = StaticGraphs(synchronising, weights=lambda: ())
    x = torch.randn(4, device="cuda")
    with caplog.at_level("WARNING", logger="dicache.static_graphs"):
        first = graphs(x)
    assert torch.equal(first, synchronising(x)) and graphs.num_graphs == 0
    assert "CUDA graph capture failed" in caplog.text
    assert torch.equal(graphs(x + 1), synchronising(x + 1))  # eager from then on, no second attempt
    assert caplog.text.count("CUDA graph capture failed") == 1
