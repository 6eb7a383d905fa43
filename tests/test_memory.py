"""Memory of a served pipeline: the text encoder's untapped parts are dropped without changing its output, FP8
weights are counted at their stored size, and the breakdown / release helpers are harmless off CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from dicache.models.krea2.pipeline import EMBEDDED_CHECKPOINT
from dicache.models.krea2.text import Krea2TextEncoder, drop_untapped_parts
from dicache.server.memory import memory_breakdown, module_bytes, release_cached_memory, tensor_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_dropping_untapped_parts_keeps_the_encoding_bitwise():
    """The embedded encoder (7 decoder layers, taps 1..6, a vision tower): loading drops the tower, the 7th layer
    and the final norm, and encodes exactly as the whole model."""
    from transformers import AutoTokenizer, Qwen3VLModel

    whole_model = Qwen3VLModel.from_pretrained(EMBEDDED_CHECKPOINT / "text_encoder").eval()
    trimmed = Krea2TextEncoder.from_pretrained(EMBEDDED_CHECKPOINT)
    whole = Krea2TextEncoder(
        AutoTokenizer.from_pretrained(EMBEDDED_CHECKPOINT / "tokenizer"), whole_model, trimmed.select_layers
    )
    assert max(trimmed.select_layers) == 6 and len(whole_model.language_model.layers) == 7
    model = trimmed.text_encoder
    assert not hasattr(model, "visual") and len(model.language_model.layers) == 6
    assert trimmed.dropped_parameters == sum(p.numel() for p in whole_model.parameters()) - sum(
        p.numel() for p in model.parameters()
    )
    assert trimmed.dropped_parameters > sum(p.numel() for p in whole_model.language_model.layers[6].parameters())
    prompts = ["a red fox in the snow", "grinning face"]
    hidden, mask = trimmed.encode(prompts)
    ref_hidden, ref_mask = whole.encode(prompts)
    assert torch.equal(mask, ref_mask) and torch.equal(hidden, ref_hidden)


def test_nothing_is_dropped_when_the_last_layer_is_tapped():
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    language = torch.nn.Module()
    language.layers, language.norm = layers, torch.nn.LayerNorm(2)
    model = torch.nn.Module()
    model.language_model = language
    assert drop_untapped_parts(model, (1, 3)) == 0 and len(layers) == 3
    assert drop_untapped_parts(model, (0, 2)) == 6 + 4 and len(layers) == 2  # a layer and the norm
    assert isinstance(language.norm, torch.nn.Identity)


def test_wrapped_weights_count_their_stored_bytes():
    fp32, fp16 = torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.float16)
    wrapped = torch.nn.Parameter(TwoTensor(fp16, fp16.clone()), requires_grad=False)  # a subclass's inner tensors
    assert tensor_bytes(fp32) == 64 and tensor_bytes(torch.nn.Parameter(fp16)) == 32 and tensor_bytes(wrapped) == 64
    linear = torch.nn.Linear(4, 4)
    linear.weight = wrapped
    assert module_bytes(linear, torch.device("cpu")) == 64 + 16 and module_bytes(None, torch.device("cpu")) == 0


def test_breakdown_and_release_are_no_ops_off_cuda():
    class CpuPipe:
        device = torch.device("cpu")

    assert memory_breakdown(CpuPipe()) is None and memory_breakdown(None) is None
    release_cached_memory("cpu")
    release_cached_memory(None)


def test_vae_norm_in_row_chunks_gives_the_same_values(monkeypatch):
    import torch.nn.functional as F

    from dicache.models.krea2 import vae

    torch.manual_seed(0)
    norm = vae.RMSNorm(24).to(torch.bfloat16)
    with torch.no_grad():
        norm.gamma.uniform_(0.5, 1.5)
        x = (torch.randn(2, 24, 37, 11) * 3).to(torch.bfloat16)
        whole = F.normalize(x.float(), dim=1).to(x.dtype) * norm.scale * norm.gamma.view(-1, 1, 1)
        monkeypatch.setattr(vae, "NORM_CHUNK_ELEMENTS", 2 * 24 * 11 * 5)  # 5 rows per chunk, the last one short
        assert torch.equal(norm(x), whole)
