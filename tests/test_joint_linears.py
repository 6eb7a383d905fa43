"""Projections of one input joined into one GEMM (`dicache.quantization.joint_linears`,
`QuantizationSpec.join_projections`)."""

import pytest
import torch
from torch import nn

from dicache.models.krea2.latents import position_ids
from dicache.models.krea2.tiny import random_tiny_transformer
from dicache.quantization import QuantizationSpec, join_selected, quantize_transformer, selected_linears
from dicache.quantization.joint_linears import JointLinear, join_linears, linear_computing, linear_outputs


def tiny_inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    hidden = torch.randn(1, 16, cfg.in_channels, generator=g)
    text = torch.randn(1, 5, cfg.num_text_layers, cfg.text_hidden_dim, generator=g)
    return hidden, text


def run(model, hidden, text):
    positions = position_ids(4, 4, torch.device("cpu"))
    with torch.no_grad():
        return model(hidden, text, torch.tensor([0.5]), positions)


def joints(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, JointLinear)}


def test_joined_projections_give_the_parts_outputs():
    model = random_tiny_transformer()
    reference = run(model, *tiny_inputs(model))
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert join_selected(model, set(), scope=names) == set()
    joined = joints(model)
    # every attention (blocks and text fusion) joins q|gate and k|v, every SwiGLU gate|up
    blocks = (
        len(model.transformer_blocks) + len(model.text_fusion.layerwise_blocks) + len(model.text_fusion.refiner_blocks)
    )
    assert sorted({n.rsplit(".", 1)[1] for n in joined}) == ["gate__up", "to_k__to_v", "to_q__to_gate"]
    assert len(joined) == 3 * blocks
    attn = model.transformer_blocks[0].attn
    assert not hasattr(attn, "to_q") and attn.to_q__to_gate.part_names == ("to_q", "to_gate")
    assert linear_computing(model, "transformer_blocks.0.attn.to_v") is attn.to_k__to_v
    assert linear_computing(model, "transformer_blocks.0.attn.to_out.0") is attn.to_out[0]
    torch.testing.assert_close(run(model, *tiny_inputs(model)), reference, rtol=1e-5, atol=1e-5)


def test_a_group_is_joined_only_where_its_parts_share_a_precision():
    model = random_tiny_transformer()
    block = "transformer_blocks.0"
    scope = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(block + ".")}
    selected = {f"{block}.attn.to_q", f"{block}.ff.gate", f"{block}.ff.up"}  # q without its gate
    out = join_selected(model, selected, scope)
    assert out == {f"{block}.attn.to_q", f"{block}.ff.gate__up"}  # q|gate would mix: apart; k|v both kept: joined
    assert sorted(joints(model)) == [f"{block}.attn.to_k__to_v", f"{block}.ff.gate__up"]
    assert isinstance(model.transformer_blocks[1].attn.to_k, nn.Linear)  # outside the scope: untouched


def test_int8_with_joined_projections_quantizes_the_joint_linears_and_matches_unjoined():
    pytest.importorskip("torchao")
    apart, joined = random_tiny_transformer(), random_tiny_transformer()
    joined.load_state_dict(apart.state_dict())
    assert QuantizationSpec("int8").join_projections is False  # the default: INT8 joining is unmeasured
    assert QuantizationSpec("fp8").join_projections is True
    names = quantize_transformer(joined, QuantizationSpec("int8", exclude=("attn_kv",), join_projections=True))
    assert names == quantize_transformer(apart, QuantizationSpec("int8", exclude=("attn_kv",)))
    assert names == sorted(selected_linears(random_tiny_transformer(), QuantizationSpec("int8", exclude=("attn_kv",))))
    block = joined.transformer_blocks[0]
    for joint in (block.attn.to_q__to_gate, block.ff.gate__up):
        assert getattr(joint.weight, "qdata", joint.weight).dtype == torch.int8
    assert block.attn.to_k__to_v.weight.dtype == torch.float32  # excluded pair joined, kept unquantized
    inputs = tiny_inputs(apart)
    got, want = run(joined, *inputs), run(apart, *inputs)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # same int8 values; only the float sums differ


def test_join_refuses_what_it_cannot_join():
    module = nn.Module()
    module.a, module.b, module.c = nn.Linear(4, 3, bias=False), nn.Linear(4, 2), nn.Linear(5, 2, bias=False)
    with pytest.raises(ValueError, match="bias-free"):
        join_linears(module, ("a", "b"))
    with pytest.raises(ValueError, match="input width"):
        join_linears(module, ("a", "c"))
    with pytest.raises(ValueError, match="two or more"):
        join_linears(module, ("a",))
    with pytest.raises(AttributeError, match="'z'"):
        linear_outputs(module, torch.zeros(1, 4), ("a", "z"))
    x = torch.randn(3, 4)
    module.d = nn.Linear(4, 6, bias=False)
    want = module.a(x), module.d(x)
    join_linears(module, ("a", "d"))
    for got, ref in zip(linear_outputs(module, x, ("a", "d")), want):
        torch.testing.assert_close(got, ref)
