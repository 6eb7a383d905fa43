"""One cuDNN attention plan for every prompt length (`dicache.models.krea2.attention_plans`): torch's variable set
unless the user set it, the plan lengths and the stand-in lengths on numbers, the pipeline's lengths at its size, and
the blocks' attention inputs laid out (B, S, H, D) in memory, the layout the shared plan needs, with joined
projections too."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from dicache.models.krea2 import Krea2Pipeline, attention_plans
from dicache.models.krea2.attention_plans import ENV, plan_length, share, shared, standing_for
from dicache.models.krea2.transformer import Attention
from dicache.quantization.joint_linears import join_linears


def test_share_sets_the_variable_unless_it_is_set():
    environ: dict[str, str] = {}
    assert share(environ) and environ == {ENV: "1"}
    kept = {ENV: "0"}
    assert not share(kept) and kept == {ENV: "0"}
    assert shared({ENV: " on "}) and shared({ENV: "true"}) and not shared({ENV: "2"}) and not shared({})


def test_torchs_notes_on_the_variable_are_hidden_only_where_dicache_set_it():
    note = f"{ENV}=1 is currently experimental. Please report any issues"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        share({ENV: "1"})  # the user's: torch's notes stay
        warnings.warn(note, UserWarning, stacklevel=1)
        share({})
        warnings.warn(note, UserWarning, stacklevel=1)
        warnings.warn("another note", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [note, "another note"]


def test_a_plan_length_is_the_power_of_two_at_or_above_only_with_shared_plans():
    assert [plan_length(s, True) for s in (1, 2, 3, 4096, 4097, 4608, 8192)] == [1, 2, 4, 4096, 8192, 8192, 8192]
    assert plan_length(4097, False) == 4097
    with pytest.raises(ValueError, match="sequence_length=0 must be >= 1"):
        plan_length(0, True)


def test_the_longest_length_of_a_plan_stands_for_every_length_of_it():
    assert standing_for(range(5, 513), 4096, True) == {n: 512 for n in range(5, 513)}  # 1024²: one plan
    crossing = standing_for([1, 700, 1024, 1025, 1100], 1024, True)  # 512²: 1024 + n tokens
    assert crossing == {1: 1024, 700: 1024, 1024: 1024, 1025: 1100, 1100: 1100}
    assert standing_for([7, 9, 7], 4096, False) == {7: 7, 9: 9}


@pytest.fixture(scope="module")
def pipe():
    return Krea2Pipeline.from_pretrained()


def test_the_pipeline_asks_for_shared_plans_and_keeps_a_users_choice(pipe, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    Krea2Pipeline(pipe.transformer)
    assert attention_plans.shared()
    monkeypatch.setenv(ENV, "0")
    Krea2Pipeline(pipe.transformer)
    assert not attention_plans.shared()


def test_the_pipelines_plan_lengths_at_a_size(pipe, monkeypatch):
    every = list(pipe.text_lengths())
    monkeypatch.setenv(ENV, "1")
    rows, cols = pipe.latent_grid(*pipe.default_size)
    assert rows * cols == 256
    assert pipe.attention_plan_lengths() == standing_for(every, 256, True)
    assert set(pipe.attention_plan_lengths().values()) == {256, 512}  # 256 + n: up to 512, 1024
    assert set(pipe.attention_plan_lengths(32, 32).values()) == {16, 48, 112, 240, 496, 512}  # 16 + n
    monkeypatch.setenv(ENV, "0")
    assert pipe.attention_plan_lengths() == {n: n for n in every}


def test_the_attention_kernel_gets_q_k_v_laid_out_bshd_with_joined_projections():
    torch.manual_seed(0)
    attn = Attention(64, num_heads=4, num_kv_heads=2, eps=1e-6)
    x = torch.randn(2, 10, 64)
    expected = attn(x)
    seen = []

    def kernel(q, k, v, key_mask):
        seen.append([t.transpose(1, 2).is_contiguous() for t in (q, k, v)])
        return Attention.kernel(q, k, v, key_mask)

    join_linears(attn, ("to_q", "to_gate"))
    join_linears(attn, ("to_k", "to_v"))  # the value becomes a view of the joint output
    attn.kernel = kernel
    torch.testing.assert_close(attn(x), expected)
    assert seen == [[True, True, True]]


CACHE_PROBE = """
import os, re, sys, warnings
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from dicache.models.krea2 import Krea2Pipeline
from dicache.models.krea2.latents import position_ids

pipe = Krea2Pipeline.from_pretrained(device="cuda")
rows, cols = pipe.latent_grid(*pipe.default_size)
positions = position_ids(rows, cols, pipe.device)
lengths = [int(n) for n in sys.argv[1].split(",")]
with warnings.catch_warnings(record=True) as caught, sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    warnings.simplefilter("always")
    for n in lengths:
        pipe.transformer.prepare_text_lengths(positions, [n])
    torch.cuda.synchronize()
note = re.compile(r"SDPA Cache Called \\d+ times. Hit rate: (\\d+)%")
rates = [m.group(1) for w in caught if (m := note.search(str(w.message)))]
print(rates[-1])
"""


@pytest.mark.gpu
@pytest.mark.parametrize("value, hit_rate", [("1", "50"), ("0", "0")])
def test_on_cuda_a_new_prompt_length_builds_no_attention_plan_with_the_shared_plan(value, hit_rate):
    """torch's cuDNN plan cache, as its debug notes count it: three prompt lengths sharing one plan at the tiny
    model's default size (their joint lengths round to the same power of two) build it once with the shared plan (the
    second length hits it: 1 of 2 earlier look-ups) and three times with a plan per length (none hits). A layout the
    shared plan cannot take (e.g. a value that is a view) would fall back to a plan per length and fail here."""
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pipe = Krea2Pipeline.from_pretrained()
    rows, cols = pipe.latent_grid(*pipe.default_size)
    stand_ins = standing_for(pipe.text_lengths(), rows * cols, True)
    same = [n for n in pipe.text_lengths() if stand_ins[n] == stand_ins[pipe.text_lengths()[-1]]][:3]
    assert len(same) == 3 and len({plan_length(n + rows * cols, False) for n in same}) == 3
    env = {**os.environ, ENV: value, "TORCH_CUDNN_SDPA_CACHE_DEBUG": "1"}
    cmd = [sys.executable, "-c", CACHE_PROBE, ",".join(map(str, same))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == hit_rate
