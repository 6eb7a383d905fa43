"""FP8 on a CUDA GPU (compute capability >= 8.9): the embedded checkpoint quantized, cached and compiled.

Run on the GPU machine: `python -m pytest -m gpu tests/test_fp8_gpu.py`. Skipped on CPU.
"""

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import dicache
from dicache.models.krea2 import Krea2Pipeline
from dicache.quantization import selected_linears
from dicache.quantization.joint_linears import linear_computing

pytestmark = pytest.mark.gpu


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10 * np.log10(1.0 / mse) if mse > 0 else float("inf")


def generate(pipe, prompt="grinning face", variant="raw", steps=12):
    out = pipe(prompt, variant=variant, num_inference_steps=steps, seed=3, output_type="np")
    return out.images[0]


def test_fp8_weights_are_stored_in_fp8_and_stay_close_to_bf16():
    ref_pipe = Krea2Pipeline.from_pretrained(device="cuda")
    pipe = Krea2Pipeline.from_pretrained(device="cuda", quantization="fp8")
    names = selected_linears(ref_pipe.transformer, pipe.transformer.quantization)
    for name in names:  # q|gate and gate|up run joined (one FP8 GEMM each)
        weight = linear_computing(pipe.transformer, name).weight
        assert "float8" in str(getattr(weight, "qdata", weight).dtype), (name, type(weight))
    assert pipe.transformer.transformer_blocks[0].attn.to_q__to_gate.part_names == ("to_q", "to_gate")
    assert pipe.transformer.img_in.weight.dtype == torch.bfloat16  # excluded by default
    ref, got = generate(ref_pipe), generate(pipe)
    assert not np.array_equal(ref, got)  # FP8 really ran
    assert psnr(ref, got) > 25.0


def test_fp8_with_caching_and_compile_does_not_recompile_after_warm_up():
    torch._dynamo.reset()
    pipe = Krea2Pipeline.from_pretrained(device="cuda", quantization="fp8", compile=True)
    pipe.set_progress_bar_config(disable=True)
    dicache.enable(pipe, {"max_warmup_steps": 2, "residual_diff_threshold": 0.5})
    generate(pipe, "red apple", "raw")
    generate(pipe, "a much longer prompt with more words in it", "turbo", 8)
    before = counters["stats"]["unique_graphs"]
    generate(pipe, "grinning face", "raw")
    generate(pipe, "dog", "turbo", 8)
    assert dicache.stats(pipe).cached_calls > 0
    assert counters["stats"]["unique_graphs"] == before
    dicache.disable(pipe)
    torch._dynamo.reset()


@pytest.mark.parametrize("method", ["fp8", "fp8-dynamic"])
def test_text_encoder_fp8_stores_fp8_weights_and_stays_close(method):
    from dicache.server.memory import module_bytes

    ref_pipe = Krea2Pipeline.from_pretrained(device="cuda")
    pipe = Krea2Pipeline.from_pretrained(device="cuda")
    model = pipe.text_encoder.text_encoder
    before = module_bytes(model, torch.device("cuda", torch.cuda.current_device()))
    names = pipe.quantize_text_encoder(method)
    assert names and all(n.startswith("language_model.layers.") for n in names)
    assert module_bytes(model, torch.device("cuda", torch.cuda.current_device())) < before
    ref, got = generate(ref_pipe), generate(pipe)
    assert not np.array_equal(ref, got) and psnr(ref, got) > 25.0


def test_an_all_zero_input_row_gives_zeros_not_nan():
    """torchao's dynamic scale of an all-zero row was 0 (NaN after quantisation): the activation floor
    (`FP8_ACTIVATION_FLOOR`) makes it zeros, and leaves the other rows as they were."""
    from dicache.quantization import fp8_linears

    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False)).to("cuda", torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    x[3] = 0
    ref = linear(x)
    fp8_linears(linear, {"0"})
    with torch.no_grad():
        got = linear(x)
    assert torch.isfinite(got).all() and bool((got[3] == 0).all())
    others = torch.cat([got[:3], got[4:]]).float()
    assert (others - torch.cat([ref[:3], ref[4:]]).float()).norm() / others.norm() < 0.1


def test_int8_compiled_with_caching_stays_close_to_bf16_and_does_not_recompile():
    torch._dynamo.reset()
    ref_pipe = Krea2Pipeline.from_pretrained(device="cuda")
    pipe = Krea2Pipeline.from_pretrained(device="cuda", quantization="int8", compile=True)
    pipe.set_progress_bar_config(disable=True)
    block_linears = ("to_k", "to_out.0", "ff.down")
    weights = [
        m.weight
        for n, m in pipe.transformer.named_modules()
        if n.startswith("transformer_blocks.") and n.endswith(block_linears)
    ]
    assert weights and all(w.qdata.dtype == torch.int8 for w in weights)
    ref, got = generate(ref_pipe), generate(pipe)
    assert not np.array_equal(ref, got) and psnr(ref, got) > 36.0  # FP8 on every linear: about 32 dB
    dicache.enable(pipe, {"max_warmup_steps": 2, "residual_diff_threshold": 0.5})
    generate(pipe, "a much longer prompt with more words in it", "turbo", 8)
    before = counters["stats"]["unique_graphs"]
    generate(pipe, "dog", "turbo", 8)
    assert dicache.stats(pipe).cached_calls > 0 and counters["stats"]["unique_graphs"] == before
    dicache.disable(pipe)
    torch._dynamo.reset()
