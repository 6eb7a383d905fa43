"""Prompt lengths cost nothing new in a request: the text path's attention needs no set-up per shape, and
`prepare_text_lengths` meets every joint length of the blocks beforehand without changing any output."""

import pytest
import torch


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_text_path_attention_runs_on_shape_free_backends_with_the_same_result(device):
    from dicache.models.krea2.attention import gqa_attention, shape_free_attention
    from dicache.models.krea2.transformer import Attention, TextFusionBlock

    block = TextFusionBlock(64, 4, 2, 128, 1e-6)
    assert block.attn.kernel is shape_free_attention and Attention.kernel is gqa_attention  # the blocks keep cuDNN
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(2, h, 7, 64, device=device, dtype=dtype) for h in (4, 2, 2))
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3], device=device)
    for key_mask in (None, mask):
        expected, got = gqa_attention(q, k, v, key_mask), shape_free_attention(q, k, v, key_mask)
        if device == "cpu":
            assert torch.equal(got, expected)  # off CUDA it is gqa_attention itself
        else:
            assert torch.allclose(got.float(), expected.float(), atol=2e-2)  # another kernel's bf16 rounding


def test_prepare_text_lengths_meets_every_joint_length_and_changes_nothing(one_torch_thread):
    from dicache.models.krea2 import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained(device="cpu")
    pipe.set_progress_bar_config(disable=True)
    encoder = pipe.text_encoder
    lengths = pipe.text_lengths()
    assert lengths[0] == encoder.num_valid_tokens("")[0]  # the empty prompt: the template's suffix alone
    assert lengths[-1] == encoder.num_valid_tokens("word " * 2000)[0]  # truncated to max_sequence_length
    before = pipe("a red apple", seed=2, num_inference_steps=4, output_type="pt").images
    weights = {name: value.clone() for name, value in pipe.transformer.state_dict().items()}
    seen = []
    block = pipe.transformer.transformer_blocks[0]
    handle = block.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    rows, cols = pipe.latent_grid(*pipe.default_size)
    positions = pipe.position_ids(rows, cols, pipe.device)[-rows * cols :]
    assert pipe.transformer.prepare_text_lengths(positions, [3, 9, 40]) == 3
    handle.remove()
    assert seen == [40 + rows * cols, 9 + rows * cols, 3 + rows * cols]  # longest first: shorter ones reuse its memory
    assert pipe.prepare_text_lengths(32, 32) == len(lengths)  # every length, at a small size: a quicker test
    after = pipe("a red apple", seed=2, num_inference_steps=4, output_type="pt").images
    assert all(torch.equal(value, weights[name]) for name, value in pipe.transformer.state_dict().items())
    # the same image; not asserted bitwise: on a CPU, float kernels may round differently at other buffer addresses
    assert torch.allclose(after, before, atol=1e-5)
