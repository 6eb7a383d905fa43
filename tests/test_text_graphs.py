"""CUDA graphs of the text encoder (issue 27: its eager time is kernel launches): the graph-ready forward builds the
attention mask transformers would, without host synchronisations, and gives the same bits; what runs where. The
replays themselves run on the GPU machine (`tests/test_text_graphs_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from dicache.models.krea2 import Krea2Pipeline
from dicache.models.krea2.checkpoints import EMBEDDED_CHECKPOINT
from dicache.models.krea2.text import Krea2TextEncoder
from dicache.models.static_graphs import StaticGraphs

pytest.importorskip("transformers")

PROMPTS = ["a red apple", "a grinning face in the rain, seen from below, with a long blue scarf"]


@pytest.fixture(scope="module")
def encoder():
    return Krea2TextEncoder.from_pretrained(EMBEDDED_CHECKPOINT)


def transformers_mask_path(encoder: Krea2TextEncoder, prompts: list[str]) -> torch.Tensor:
    """The tapped states with the 2-D padding mask handed to transformers, which builds the 4-D mask itself."""
    ids, mask = encoder.tokenize(prompts)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = encoder.text_encoder(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions.unsqueeze(0).expand(3, -1, -1),
            output_hidden_states=True,
            use_cache=False,
        )
    return torch.stack([out.hidden_states[i] for i in encoder.select_layers], dim=2)[:, encoder.prefix_len :]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_prepared_mask_gives_the_bits_of_transformers_own(encoder, implementation):
    """Padded prompts and one that fills every position (transformers then drops the mask for a causal kernel)."""
    encoder.text_encoder.set_attn_implementation(implementation)
    try:
        assert encoder.text_encoder.language_model.config._attn_implementation == implementation
        full = " ".join(["word"] * (encoder.max_sequence_length + 50))
        for prompts in (PROMPTS, [full]):
            hidden, mask = encoder.encode(prompts)
            assert torch.equal(hidden, transformers_mask_path(encoder, prompts))
        assert encoder.num_valid_tokens([full]) == [encoder.max_sequence_length]
        prepared = encoder._attention_mask(encoder.tokenize(PROMPTS)[1])
        assert prepared.shape == (2, 1, prepared.shape[-1], prepared.shape[-1])
        assert prepared.dtype == (torch.bool if implementation == "sdpa" else torch.float32)
    finally:
        encoder.text_encoder.set_attn_implementation("sdpa")


def test_graphs_on_a_cpu_encoder_run_eagerly_with_the_same_values(encoder):
    eager, _ = encoder.encode(PROMPTS)
    encoder.use_cuda_graphs()
    try:
        assert encoder.cuda_graphs
        again, _ = encoder.encode(PROMPTS)
        assert torch.equal(again, eager)
        assert encoder._graphs.captures == 0 and encoder._graphs.num_graphs == 0
    finally:
        encoder.use_cuda_graphs(False)
    assert not encoder.cuda_graphs


def test_graphs_refuse_an_attention_that_synchronises(encoder):
    encoder.text_encoder.language_model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="'flash_attention_2' is not supported; allowed: sdpa, eager"):
            encoder.use_cuda_graphs()
    finally:
        encoder.text_encoder.language_model.config._attn_implementation = "sdpa"
    assert not encoder.cuda_graphs


def test_static_graphs_call_cpu_work_eagerly_and_check_their_limits():
    calls = []

    def double(x):
        calls.append(x.shape)
        return x * 2

    graphs = StaticGraphs(double, weights=lambda: ())
    assert torch.equal(graphs(torch.ones(3)), torch.full((3,), 2.0))
    assert calls == [(3,)] and graphs.num_graphs == 0 and graphs.captures == 0
    with pytest.raises(ValueError, match="max_graphs=0, warmup_calls=2: both must be at least 1"):
        StaticGraphs(double, weights=lambda: (), max_graphs=0)


def test_compile_turns_graphs_on_only_for_a_resident_cuda_encoder():
    pipe = Krea2Pipeline.from_pretrained().compile(backend="eager", vae=False)
    assert not pipe.text_encoder.cuda_graphs  # CPU: nothing to replay
    with pytest.raises(ValueError, match=r"need it resident on a CUDA device; it is on cpu"):
        Krea2Pipeline.from_pretrained().compile(backend="eager", vae=False, text_encoder=True)
    torch._dynamo.reset()


def test_encode_prompt_hands_the_mask_over_on_the_host():
    pipe = Krea2Pipeline.from_pretrained()
    embeds, mask = pipe.encode_prompt(PROMPTS)
    assert mask.device.type == "cpu" and mask.dtype == torch.bool
    assert torch.equal(mask, pipe.text_encoder.encode(PROMPTS)[1])
    on_host = pipe.text_conditioning(embeds, mask, 2)
    on_device = pipe.text_conditioning(embeds, mask.to(pipe.device), 2)
    assert torch.equal(on_host.tokens, on_device.tokens) and torch.equal(on_host.key_mask, on_device.key_mask)
    assert on_host.tokens.shape[0] == 4 and on_host.key_mask.device == on_host.tokens.device
