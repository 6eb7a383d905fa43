"""`--quantization fp8-emulated`: the FP8 model's linears and arithmetic, emulated in float32 on the CPU, through the
loading, calibrate and sweep paths users run (dicache/quantization/weights.py)."""

import json

import pytest
import torch

from dicache.models.krea2 import Krea2Pipeline
from dicache.quantization import DEFAULT_EXCLUDE, QuantizationSpec, parse_quantization, selected_linears
from dicache.sweep.metrics import psnr


def fp8_rowwise_gemm(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """A real FP8 GEMM (torch._scaled_mm on the CPU) with torchao's per-row scales: `amax / 448` per activation row
    and per weight output channel, e4m3 operands, float32 output, plus any bias."""
    x2, w = x.reshape(-1, x.shape[-1]).float(), linear.weight.detach().float()
    sx, sw = x2.abs().amax(1, keepdim=True) / 448, w.abs().amax(1, keepdim=True) / 448
    qx, qw = (x2 / sx).to(torch.float8_e4m3fn), (w / sw).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.float32)
    if linear.bias is not None:
        out = out + linear.bias.float()
    return out.reshape(*x.shape[:-1], -1)


def test_the_emulated_method_takes_fp8s_selection_and_joins_nothing():
    spec = parse_quantization("fp8-emulated")
    assert spec.method == "fp8-emulated" and spec.exclude == DEFAULT_EXCLUDE["fp8"] == ("attn_kv", "attn_out")
    assert spec.join_projections is False and parse_quantization("fp8").join_projections is True
    assert parse_quantization("fp8-emulated", ["none"]).exclude == ()


def test_emulated_fp8_loads_fp8s_linears_and_computes_a_real_fp8_gemm():
    pipe = Krea2Pipeline.from_pretrained("dicache/assets/krea2-tiny-turbo", device="cpu", dtype=torch.bfloat16)
    emulated = Krea2Pipeline.from_pretrained(
        "dicache/assets/krea2-tiny-turbo", device="cpu", dtype=torch.bfloat16, quantization="fp8-emulated"
    )
    names = sorted(selected_linears(pipe.transformer, QuantizationSpec("fp8")))
    modules = dict(emulated.transformer.named_modules())
    changed = sorted(n for n, m in modules.items() if "fp8_weight" in vars(m))
    assert changed == names and len(names) == 5 * len(pipe.transformer.transformer_blocks)  # q, gate, ff gate/up/down
    assert "fp8_weight" not in vars(modules["transformer_blocks.0.attn.to_k"])  # kept in bf16, as fp8 keeps it
    linear = modules["transformer_blocks.0.ff.down"]
    assert linear.bias is None
    x = torch.randn(2, 7, linear.in_features, dtype=torch.bfloat16)
    y = linear(x)
    assert y.dtype == torch.bfloat16
    expected = fp8_rowwise_gemm(x, linear)
    assert torch.allclose(y.float(), expected, rtol=1 / 128, atol=1e-3)  # bf16 rounding of the output only
    exact = x.float() @ linear.weight.float().t()
    assert (y.float() - exact).abs().max() > 10 * (y.float() - expected).abs().max()  # FP8's error, not bf16's

    def image(p):
        kw = dict(seed=3, num_inference_steps=8, variant="turbo", height=64, width=64, output_type="pt")
        return p(["a red apple on a table"], **kw).images.float()

    pipe.set_progress_bar_config(disable=True)
    emulated.set_progress_bar_config(disable=True)
    reference, fp8 = image(pipe), image(emulated)
    assert not torch.equal(fp8, reference) and 25.0 < psnr(fp8, reference)[0] < 60.0


def test_calibrate_for_the_fp8_model_on_the_cpu(tmp_path, capsys):
    from dicache.cli import main

    candidates = tmp_path / "c.json"
    candidates.write_text(json.dumps([{"policy": "never"}]))  # every block computed: the quantization's own error
    out = tmp_path / "fp8.json"
    argv = ["calibrate", "--variant", "turbo", "--steps", "4", "--size", "32", "--prompts", "1", "--device", "cpu"]
    argv += ["--dtype", "bfloat16", "--no-step-masks", "--candidates", str(candidates), "--target-psnr", "20"]
    assert main([*argv, "--out", str(out), "--quantization", "fp8-emulated", "--no-progress"]) == 0
    record = json.loads(out.read_text())["calibration"]
    assert record["quantization"] == {"method": "fp8-emulated", "exclude": ["attn_kv", "attn_out"]}
    uncached = record["candidates"][0]
    assert uncached["compute_fraction"] == 1.0 and 20 < uncached["psnr_min_db"] < 100  # FP8 against bf16, not 100
    capsys.readouterr()


def test_an_emulated_transformer_keeps_no_weight_snapshot(tmp_path):
    from dicache.models.krea2.checkpoints import load_transformer

    spec = parse_quantization("fp8-emulated")
    outcomes: dict = {}
    model = load_transformer(
        "dicache/assets/krea2-tiny-turbo", spec, tmp_path, dtype=torch.bfloat16, device=torch.device("cpu"),
        outcomes=outcomes,
    )  # fmt: skip
    assert not list(tmp_path.iterdir()) and not outcomes  # its rounded weights live outside the state dict
    assert "fp8_weight" in vars(model.transformer_blocks[0].ff.down)


@pytest.mark.parametrize("value", ["fp9", "emulated"])
def test_a_quantization_outside_the_methods_is_refused_naming_them(value):
    from dicache.quantization import QuantizationError

    with pytest.raises(QuantizationError, match=f"quantization='{value}'.*fp8-emulated"):
        parse_quantization(value)
