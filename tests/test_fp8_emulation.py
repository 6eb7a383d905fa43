"""FP8 on a CPU: the emulated e4m3 quantisation (`dicache.quantization.fp8_emulation`) follows torchao's arithmetic,
its block scales isolate an outlier, and the Hadamard rotation (`dicache.quantization.hadamard`) is an exact,
self-inverse change of basis that leaves a linear layer's output unchanged."""

from __future__ import annotations

import pytest
import torch

from dicache.quantization import QuantizationError, parse_quantization
from dicache.quantization.fp8_emulation import (
    ACTIVATION_BLOCK,
    E4M3_MAX,
    PER_ROW,
    EmulatedScheme,
    emulate_fp8,
    fake_quantize,
    restore_linears,
)
from dicache.quantization.hadamard import HadamardRotation, block_size, hadamard_matrix


def test_hadamard_matrices_are_symmetric_orthogonal_and_flat():
    for n in (1, 2, 8, 64):
        h = hadamard_matrix(n, torch.float64)
        assert torch.equal(h, h.T) and torch.allclose(h @ h, torch.eye(n, dtype=torch.float64), atol=1e-14)
        assert torch.all(h.abs() == 1 / n**0.5)
    with pytest.raises(ValueError, match="n=12 is invalid: must be a power of two"):
        hadamard_matrix(12)


def test_rotation_blocks_follow_the_input_width():
    assert [block_size(k) for k in (6144, 16384, 448, 256, 3)] == [2048, 2048, 64, 256, 1]
    assert block_size(6144, max_block=128) == 128 and block_size(96, max_block=100) == 32
    rotation = HadamardRotation(6144)
    assert rotation.block == 2048 and rotation.factors == (32, 64)


def test_rotation_is_exact_self_inverse_and_keeps_a_linear_output():
    torch.manual_seed(0)
    x, w = torch.randn(5, 3, 96, dtype=torch.float64), torch.randn(40, 96, dtype=torch.float64)
    rotation = HadamardRotation(96)  # 3 blocks of 32 = 4 x 8
    h1, h2 = rotation.matrices(torch.float64)
    rotated = rotation.apply(x, h1, h2)
    assert torch.allclose(rotation.apply(rotated, h1, h2), x, atol=1e-12)  # R R = I
    assert torch.allclose(rotated @ rotation.apply(w, h1, h2).T, x @ w.T, atol=1e-12)  # (x R)(W R)^T = x W^T
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-12)
    spike = torch.zeros(96, dtype=torch.float64)
    spike[40] = 1.0  # one outlier channel, in the second block: spread evenly over that block, nothing elsewhere
    spread = rotation.apply(spike, h1, h2)
    assert torch.allclose(spread[32:64].abs(), torch.full((32,), 32**-0.5, dtype=torch.float64))
    assert not spread[:32].any() and not spread[64:].any()
    with pytest.raises(ValueError, match="has 95 features, expected 96"):
        rotation.apply(torch.zeros(95, dtype=torch.float64), h1, h2)


def test_fake_quantize_follows_torchaos_per_row_arithmetic():
    x = torch.tensor([[896.0, 3.0, -1.0, 0.3], [0.0, 0.0, 0.0, 0.0]])
    q = fake_quantize(x, PER_ROW)
    scale = 896.0 / E4M3_MAX  # 2: the row's largest magnitude maps to 448
    expected = (x[0] / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(q[0], expected) and torch.equal(q[1], x[1])  # a zero row stays zero, no NaN
    assert q[0, 0] == 896.0 and q[0, 1] == 3.0 and q[0, 3] != 0.3  # 0.15 on the e4m3 grid rounds to 0.15625
    assert q.dtype == torch.float32 and fake_quantize(x.to(torch.bfloat16)).dtype == torch.float32


def test_block_scales_keep_an_outlier_to_its_block():
    torch.manual_seed(1)
    x = torch.randn(3, 256) * 1e-3
    x[0, 5] = 1e4  # an outlier in the first 128-wide block of row 0
    per_row, per_block = fake_quantize(x, PER_ROW), fake_quantize(x, ACTIVATION_BLOCK)
    other = x[0, 128:].abs().max()  # the other block of the outlier's row
    error = lambda q: (q - x)[0, 128:].abs().max() / other  # noqa: E731
    assert error(per_block) < 0.07 and error(per_row) > 0.5  # per row, the small values fall below e4m3's range
    assert torch.equal(per_block[1:], fake_quantize(x[1:], ACTIVATION_BLOCK))  # rows never share a scale
    weight = torch.randn(200, 300)  # partial 128 x 128 tiles at both edges
    assert fake_quantize(weight, (128, 128)).shape == weight.shape


def test_emulated_linears_carry_fp8_error_and_restore_exactly():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    x = torch.randn(16, 64)
    exact = model(x)
    for scheme in (EmulatedScheme(), EmulatedScheme(rotation_block=64)):
        assert emulate_fp8(model, ["0", "1"], scheme) == ["0", "1"]
        out = model(x)
        relative = ((out - exact).norm() / exact.norm()).item()
        assert 1e-3 < relative < 0.1  # e4m3 keeps 3 mantissa bits: a few percent, not zero, not garbage
        restore_linears(model)
        assert torch.equal(model(x), exact)
    with pytest.raises(TypeError, match="not an nn.Linear"):
        emulate_fp8(model, [""])


def test_an_empty_exclusion_is_spelled_none():
    assert parse_quantization("fp8", ["none"]).exclude == ()
    with pytest.raises(QuantizationError, match="'none' .* must stand alone"):
        parse_quantization("fp8", ["none", "attn_gate"])


def test_text_encoder_fp8_is_checked_before_anything_runs(capsys):
    from dicache.cli import main
    from dicache.quantization import quantize_text_encoder

    with pytest.raises(QuantizationError, match="text encoder quantization='int4' is invalid"):
        quantize_text_encoder(torch.nn.Linear(2, 2), "int4")
    with pytest.raises(QuantizationError, match="no linear of Linear matches"):
        quantize_text_encoder(torch.nn.Linear(2, 2))
    code = main(["generate", "x", "--device", "cpu", "--text-encoder-quantization", "fp8", "--dit-cpu-offload"])
    assert code == 2 and "cannot be combined with the memory options" in capsys.readouterr().err


def test_emulated_int8_matches_torchaos_int8_linear_on_the_cpu():
    pytest.importorskip("torchao")
    from dicache.quantization import int8_linears

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(256, 64, bias=False))
    x = torch.randn(8, 256)
    x[2] = 0.0
    emulate_fp8(model, ["0"], EmulatedScheme(fmt="int8"))
    emulated = model(x)
    restore_linears(model)
    exact = model(x)
    int8_linears(model, {"0"})
    real = model(x)
    # the same scales and integers but where x / scale falls within float rounding of a half (torchao multiplies by
    # the reciprocal): a rare one-step difference
    assert ((emulated - real).norm() / real.norm()).item() < 1e-3
    assert not emulated[2].any()
    relative = ((emulated - exact).norm() / exact.norm()).item()
    assert 1e-4 < relative < 0.02  # eight significant bits: well under e4m3's few per cent
    with pytest.raises(ValueError, match="fmt='int4' is invalid"):
        fake_quantize(x, PER_ROW, "int4")
