"""The 8-bit attention kernel of `experiments/fp8_attention_kernel.py` (a measured candidate, not the product's path)
computes its float32 reference on a CUDA GPU with FP8 tensor cores, masked or not, grouped heads and ragged lengths.

Run on the GPU machine: `python -m pytest -m gpu tests/test_fp8_attention_gpu.py`. Skipped on CPU.
"""

import pathlib
import sys

import pytest
import torch

from dicache.quantization.fp8_attention_emulation import Fp8AttentionScheme, fp8_attention_reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernel():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
    import fp8_attention_kernel  # experiment code: imports triton

    return fp8_attention_kernel


@pytest.mark.parametrize("scheme", [Fp8AttentionScheme("int8"), Fp8AttentionScheme("e4m3"),
                                    Fp8AttentionScheme("int8", pv_fmt="bf16")])  # fmt: skip
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_computes_its_reference(kernel, scheme, masked):
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(2, 8, 333, 64, device="cuda", generator=gen).bfloat16()
    k = (torch.randn(2, 2, 333, 64, device="cuda", generator=gen) + 0.5).bfloat16()
    v = torch.randn(2, 2, 333, 64, device="cuda", generator=gen).bfloat16()
    mask = None
    if masked:
        mask = torch.ones(2, 333, dtype=torch.bool, device="cuda")
        mask[0, 200:] = False
        mask[1, :150] = False  # whole key blocks masked before the first valid one
    out = kernel.fp8_attention(q, k, v, mask, scheme)
    ref = fp8_attention_reference(q, k, v, mask, scheme)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert (out.float() - ref.float()).abs().max().item() < 0.02
