"""The 8-bit attention scheme emulated in float32 (`dicache.quantization.fp8_attention_emulation`): operand layout
and scales, and the reference's agreement with exact attention, its masking, grouping and key smoothing."""

import math
import pathlib
import sys

import pytest
import torch

from dicache.models.krea2.attention import gqa_attention
from dicache.quantization.fp8_attention_emulation import (
    Fp8AttentionScheme,
    fp8_attention_reference,
    quantize_attention_inputs,
)
from dicache.quantization.fp8_emulation import E4M3_MAX


def operands(seed=0, batch=2, q_heads=4, kv_heads=2, tokens=40, head_dim=16, key_offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, tokens, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen) + key_offset
    v = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen)
    return q, k, v


def snr_db(out, exact):
    return 10 * math.log10(exact.pow(2).mean() / (out - exact).pow(2).mean())


def test_operands_have_the_kernels_dtypes_layout_and_scales():
    q, k, v = operands()
    q8, q_scale, k8, k_scale, v8, v_scale = quantize_attention_inputs(q, k, v, Fp8AttentionScheme("int8"))
    assert q8.dtype == k8.dtype == torch.int8 and v8.dtype == torch.float8_e4m3fn
    assert q_scale.shape == (2, 4, 40) and k_scale.shape == (2, 2, 40) and v_scale.shape == (2, 2, 16)
    assert v8.shape == (2, 2, 16, 40) and v8.is_contiguous()  # channels contiguous over the keys
    # Q's scale carries log2(e)/sqrt(D): dequantised Q is the base-2 logit's query, each row's largest value at 127.5
    dequantised = q8.float() * q_scale[..., None]
    assert torch.allclose(dequantised, q * math.log2(math.e) / 4.0, atol=0.05)
    assert q8.float().abs().amax(dim=-1).min() >= 127
    # V per channel: each channel's largest magnitude maps to E4M3_MAX
    assert torch.allclose(v8.float().abs().amax(dim=-1), torch.full((2, 2, 16), E4M3_MAX))
    e4m3 = quantize_attention_inputs(q, k, v, Fp8AttentionScheme("e4m3"))
    assert e4m3[0].dtype == e4m3[2].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("scheme", "floor_db"),
    [
        (Fp8AttentionScheme("int8"), 24.0),
        (Fp8AttentionScheme("e4m3"), 21.0),
        (Fp8AttentionScheme("int8", pv_fmt="bf16"), 33.0),
    ],
)
def test_reference_stays_close_to_exact_attention(scheme, floor_db):
    q, k, v = operands()
    exact = gqa_attention(q, k, v)
    value = snr_db(fp8_attention_reference(q, k, v, None, scheme), exact)
    assert floor_db < value < 60  # rounded, but close


def test_p_rounding_is_the_larger_error():
    q, k, v = operands()
    exact = gqa_attention(q, k, v)
    fp8_pv = snr_db(fp8_attention_reference(q, k, v, None, Fp8AttentionScheme("int8")), exact)
    bf16_pv = snr_db(fp8_attention_reference(q, k, v, None, Fp8AttentionScheme("int8", pv_fmt="bf16")), exact)
    assert bf16_pv > fp8_pv + 3


def test_masked_keys_get_no_weight():
    q, k, v = operands()
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, 30:] = False
    mask[1, :7] = False
    out = fp8_attention_reference(q, k, v, mask)
    assert snr_db(out, gqa_attention(q, k, v, mask)) > 24.0
    assert snr_db(out, gqa_attention(q, k, v)) < 15.0


def test_grouped_heads_read_their_kv_head():
    q, k, v = operands()
    grouped = fp8_attention_reference(q, k, v)
    for head in range(4):
        single = fp8_attention_reference(
            q[:, head : head + 1], k[:, head // 2 : head // 2 + 1], v[:, head // 2 :][:, :1]
        )
        assert torch.allclose(grouped[:, head : head + 1], single, atol=1e-6)


def test_key_smoothing_helps_keys_with_an_offset():
    q, k, v = operands(key_offset=torch.linspace(-6, 6, 16).view(1, 1, 1, 16))
    exact = gqa_attention(q, k, v)
    smooth = snr_db(fp8_attention_reference(q, k, v, None, Fp8AttentionScheme("int8", pv_fmt="bf16")), exact)
    plain = snr_db(
        fp8_attention_reference(q, k, v, None, Fp8AttentionScheme("int8", smooth_k=False, pv_fmt="bf16")), exact
    )
    assert smooth > plain + 3


def test_output_keeps_the_query_dtype():
    q, k, v = (t.bfloat16() for t in operands())
    assert fp8_attention_reference(q, k, v).dtype == torch.bfloat16


@pytest.mark.parametrize(("field", "value"), [("qk_fmt", "fp4"), ("pv_fmt", "int8")])
def test_bad_formats_name_the_field_and_the_allowed_values(field, value):
    with pytest.raises(ValueError, match=rf"{field}='{value}' is invalid: must be one of"):
        Fp8AttentionScheme(**{field: value})


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ("attention:int8,nosmoth", "unknown flag(s) nosmoth; allowed: nosmooth, pvbf16, vhead"),
        ("attention:fp4", "qk_fmt='fp4' is invalid: must be one of e4m3, int8"),
        ("atention:int8", "unknown scheme(s) atention; allowed: row, block, hadamard, int8, attention"),
    ],
)
def test_bench_fp8_refuses_a_bad_attention_part_before_loading(part, message, capsys):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_fp8  # benchmark code, on the path only here

    with pytest.raises(SystemExit):
        bench_fp8.main(["--sections", "emulated", "--device", "cpu", "--emulate", part])
    assert message in capsys.readouterr().err
