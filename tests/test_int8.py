"""INT8 (`--quantization int8`) runs for real on the CPU: torchao's dynamic per-row INT8 on the embedded checkpoint."""

import pytest
import torch

from dicache.models.krea2 import Krea2Pipeline
from dicache.quantization import (
    DEFAULT_EXCLUDE,
    QuantizationError,
    QuantizationSpec,
    check_int8_support,
    parse_quantization,
    selected_linears,
)
from dicache.sweep.metrics import psnr

pytest.importorskip("torchao")


def turbo_image(pipe: Krea2Pipeline) -> torch.Tensor:
    out = pipe(["a red apple on a table"], seed=5, num_inference_steps=8, variant="turbo", output_type="pt")
    return out.images.float()


def test_int8_quantises_every_block_linear_by_default_and_keeps_fp8s_default():
    int8, fp8 = parse_quantization("int8"), parse_quantization("fp8")
    assert int8.method == "int8" and int8.exclude == () == DEFAULT_EXCLUDE["int8"]
    assert fp8.exclude == DEFAULT_EXCLUDE["fp8"] == ("attn_kv", "attn_out")
    assert parse_quantization("int8", ["attn_out"]).exclude == ("attn_out",)
    assert QuantizationSpec("int8").exclude == ()


def test_int8_on_the_cpu_stores_int8_weights_and_stays_close_to_bf16():
    pipe = Krea2Pipeline.from_pretrained(device="cpu", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    reference = turbo_image(pipe)
    names = pipe.quantize("int8")
    assert names == sorted(selected_linears(pipe.transformer, QuantizationSpec("int8")))
    assert len(names) == 8 * len(pipe.transformer.transformer_blocks)  # every block linear
    modules = dict(pipe.transformer.named_modules())
    assert all(modules[n].weight.qdata.dtype == torch.int8 for n in names)
    assert modules["img_in"].weight.dtype == torch.bfloat16  # outside the blocks: untouched
    image = turbo_image(pipe)
    assert not torch.equal(image, reference)  # INT8 really ran
    assert psnr(image, reference)[0] > 38.0  # FP8 with every block linear: about 32 dB on this checkpoint


def test_an_all_zero_row_stays_zero_under_int8():
    layer = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
    from dicache.quantization import int8_linears

    int8_linears(layer, {"0"})
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    x[1] = torch.randn(64)
    y = layer(x)
    assert torch.isfinite(y).all() and not y[0].any() and y[1].abs().sum() > 0


def test_int8_refuses_a_device_it_cannot_run_on():
    with pytest.raises(QuantizationError, match="int8.*'meta'"):
        check_int8_support("meta")
