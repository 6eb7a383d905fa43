"""`--text-encoder-quantization fp8` on a CPU: the text encoder's decoder-layer weights stored in FP8
(`dicache.quantization.fp8_storage`), computed in the activation dtype; `fp8-dynamic` (FP8 GEMMs) needs an FP8 GPU
(test_fp8_gpu.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image

from dicache.cli import main
from dicache.models.krea2 import Krea2Pipeline
from dicache.quantization import TEXT_ENCODER_FP8_INCLUDE, QuantizationError, quantize_text_encoder
from dicache.quantization.fp8_storage import Float8StoredLinear, power_of_two_scales
from dicache.server.memory import module_bytes

CPU = torch.device("cpu")


def _image(pipe) -> np.ndarray:
    out = pipe("a red apple on a table", num_inference_steps=6, generator=torch.Generator().manual_seed(3))
    return np.asarray(out.images[0]).astype(np.float64)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0**2 / ((a - b) ** 2).mean()))


def test_fp8_weight_storage_quarters_the_float32_weights_and_stays_close():
    pipe = Krea2Pipeline.from_pretrained(device="cpu")
    pipe.set_progress_bar_config(disable=True)
    model = pipe.text_encoder.text_encoder
    ref = _image(pipe)
    before = module_bytes(model, CPU)
    inductor = torch._inductor.config
    tuning = (inductor.coordinate_descent_tuning, inductor.coordinate_descent_check_all_directions)
    names = pipe.quantize_text_encoder("fp8")
    # torch.compile's process-wide settings untouched (torchao's default would turn its slower tuning on)
    assert (inductor.coordinate_descent_tuning, inductor.coordinate_descent_check_all_directions) == tuning
    assert names and all(n.startswith("language_model.layers.") for n in names)
    layer = model.get_submodule(names[0])
    assert isinstance(layer, Float8StoredLinear) and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.scale.shape == (layer.out_features, 1)
    linear_bytes = sum(model.get_submodule(n).in_features * model.get_submodule(n).out_features for n in names)
    assert before - module_bytes(model, CPU) >= 0.9 * 3 * linear_bytes  # float32 (4 bytes) to FP8 (1) per weight
    got, again = _image(pipe), _image(pipe)
    assert np.array_equal(got, again)  # deterministic
    assert not np.array_equal(ref, got) and _psnr(ref, got) > 35.0


def test_the_text_encoder_methods_are_checked_and_dynamic_fp8_needs_a_gpu():
    with pytest.raises(
        QuantizationError, match="quantization='int8' is invalid: must be one of none, fp8, fp8-dynamic"
    ):
        quantize_text_encoder(torch.nn.Linear(2, 2), "int8")
    with pytest.raises(QuantizationError, match=re.escape(f"no linear of Linear matches {TEXT_ENCODER_FP8_INCLUDE}")):
        quantize_text_encoder(torch.nn.Linear(2, 2))
    pytest.importorskip("torchao")
    if not torch.cuda.is_available():
        pipe = Krea2Pipeline.from_pretrained(device="cpu")
        with pytest.raises(QuantizationError, match="needs an NVIDIA GPU with FP8 tensor cores"):
            pipe.quantize_text_encoder("fp8-dynamic")


def test_generate_with_the_text_encoder_in_fp8(tmp_path, capsys):
    out = tmp_path / "apple.png"
    args = ["generate", "red apple", "--device", "cpu", "--variant", "turbo", "--out", str(out)]
    assert main([*args, "--text-encoder-quantization", "fp8"]) == 0
    fp8 = np.asarray(Image.open(out)).astype(np.float64)
    assert main(args) == 0
    bf = np.asarray(Image.open(out)).astype(np.float64)
    assert fp8.shape == bf.shape and _psnr(bf, fp8) > 30.0
    with pytest.raises(SystemExit) as exited:
        main([*args, "--text-encoder-quantization", "int4"])
    err = capsys.readouterr().err
    assert (
        exited.value.code == 2 and "--text-encoder-quantization: invalid choice: 'int4'" in err and "fp8-dynamic" in err
    )


def test_float8_stored_linear_is_the_scaled_e4m3_weight_exactly():
    """Power-of-two scales bring each row's peak into (224, 448] (e4m3's top binade: no precision lost to the scale),
    and the layer computes exactly x @ (q * s).T: e4m3 -> float32 and the scaling are exact."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-6, 3, 24, dtype=torch.float64)[:, None])  # rows of very different sizes
        linear.weight[5] = 0.0  # an all-zero row
    stored = Float8StoredLinear.from_linear(linear)
    scale = power_of_two_scales(linear.weight)
    assert torch.equal(stored.scale, scale) and torch.equal(torch.log2(scale), torch.log2(scale).round())
    peaks = stored.weight.float().abs().amax(dim=1)
    assert ((peaks > 224) & (peaks <= 448)).sum() == 23 and peaks[5] == 0
    dequantized = stored.weight.double() * stored.scale.double()
    x = torch.randn(7, 64, dtype=torch.float64)
    torch.testing.assert_close(stored(x), x @ dequantized.T + linear.bias, rtol=1e-12, atol=0)
    # e4m3's four significant bits: every weight within half a step (2^-4 relative) of the original, or, below
    # e4m3's normal range (2^-6 of the scale), within half its subnormal step (2^-10 of the scale)
    error = (dequantized - linear.weight.detach()).abs()
    bound = torch.maximum(linear.weight.detach().abs() * 2**-4, stored.scale.double() * 2**-10)
    assert (error <= bound).all()
    assert torch.equal(stored(torch.zeros(1, 64, dtype=torch.float64))[0], linear.bias.detach())
    assert stored.weight.element_size() == 1 and stored(x.float()).dtype == torch.float32


def test_float8_stored_linear_rejects_what_it_cannot_hold():
    with pytest.raises(ValueError, match=r"expected a 2-D float8_e4m3fn weight \(out, in\) and a \(out, 1\) scale"):
        Float8StoredLinear(torch.zeros(4, 3), torch.ones(4, 1))


def test_compiled_stored_linears_keep_the_eager_values_with_one_graph_per_bias_choice():
    from torch._dynamo.testing import CompileCounter

    from dicache.quantization.fp8_storage import compile_stored_linears, store_linears_in_fp8

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32, bias=False))
    store_linears_in_fp8(model, {"0", "2"})
    short, long = torch.randn(2, 5, 64), torch.randn(2, 9, 64)
    eager = model(short), model(long)
    counter = CompileCounter()
    assert compile_stored_linears(model, counter) == 2
    assert all(m.arithmetic is model[0].arithmetic for m in (model[0], model[2]))  # one function for every layer
    torch.testing.assert_close(model(short), eager[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(model(long), eager[1], rtol=0, atol=1e-6)  # a new token count: no new graph
    assert counter.frame_count == 2  # with and without a bias


def test_encoder_compile_runs_its_fp8_stored_linears_compiled_with_the_eager_values():
    from torch._dynamo.testing import CompileCounter

    from dicache.models.krea2.checkpoints import EMBEDDED_CHECKPOINT
    from dicache.models.krea2.text import Krea2TextEncoder

    encoder = Krea2TextEncoder.from_pretrained(EMBEDDED_CHECKPOINT, device="cpu")
    names = quantize_text_encoder(encoder.text_encoder, "fp8")
    eager = encoder.encode(["a red apple"])[0]
    counter = CompileCounter()
    assert encoder.compile(counter) == len(names)
    assert encoder.cuda_graphs  # on a CPU the "graphs" run eagerly
    torch.testing.assert_close(encoder.encode(["a red apple"])[0], eager, rtol=0, atol=0)
    assert counter.frame_count >= 1
