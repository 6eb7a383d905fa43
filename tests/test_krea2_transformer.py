"""Native Krea-2 transformer against diffusers 0.42.1 `Krea2Transformer2DModel` (tiny random configs, CPU, fp32)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dicache.models.krea2.tiny import reference_transformer_config
from dicache.models.krea2.transformer import (
    Krea2Transformer,
    RMSNorm,
    TextConditioning,
    keeps_fp32,
    pack_valid_tokens,
)
from dicache.models.loading import CheckpointError

diffusers = pytest.importorskip("diffusers")
from diffusers import Krea2Transformer2DModel  # noqa: E402

_BASE = reference_transformer_config()
TEXT_LAYERS, TEXT_DIM, IN_CHANNELS = _BASE["num_text_layers"], _BASE["text_hidden_dim"], _BASE["in_channels"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# Depths 1-3; GQA ratios 1, 2 and 4 in the image blocks (and 1 / 2 in the text fusion blocks).
CONFIGS = {
    "gqa1_depth1": reference_transformer_config(num_layers=1, num_key_value_heads=4, text_num_key_value_heads=4),
    "gqa2_depth2": reference_transformer_config(),
    "gqa4_depth3": reference_transformer_config(
        num_layers=3, attention_head_dim=8, num_attention_heads=8, num_key_value_heads=2, axes_dims_rope=(2, 2, 4)
    ),
}


def reference_model(config: dict, seed: int = 0) -> Krea2Transformer2DModel:
    """A diffusers model whose every parameter is random, including the zero-initialised norms and tables."""
    model = Krea2Transformer2DModel(**config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "scale_shift_table" not in name:
                std = param.shape[1] ** -0.5  # linear weights: unit-variance outputs
            else:
                std = 0.3  # biases, RMSNorm weights (scale 1 + w), modulation tables
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model


def native_copy(reference: Krea2Transformer2DModel) -> Krea2Transformer:
    model = Krea2Transformer.from_config_dict(dict(reference.config)).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    return model


def krea_position_ids(text_len: int, height: int, width: int) -> torch.Tensor:
    """As Krea-2's pipeline builds them: `(text_len + height * width, 3)`, text rows zero, image rows `(0, h, w)`."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    image = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return torch.cat([torch.zeros(text_len, 3), image.float()])


def make_inputs(batch: int, text_len: int, grid: tuple[int, int], valid: list[tuple[int, int]] | None, seed: int = 1):
    """Random inputs; `valid[b] = (prompt_len, suffix_len)` gives Krea's `[prompt | PAD | suffix]` text layout."""
    gen = torch.Generator().manual_seed(seed)
    height, width = grid
    inputs = dict(
        hidden_states=torch.randn(batch, height * width, IN_CHANNELS, generator=gen),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_LAYERS, TEXT_DIM, generator=gen),
        timestep=torch.rand(batch, generator=gen),
        position_ids=krea_position_ids(text_len, height, width),
        encoder_attention_mask=None,
    )
    if valid is not None:
        mask = torch.zeros(batch, text_len, dtype=torch.bool)
        for row, (prompt_len, suffix_len) in enumerate(valid):
            mask[row, :prompt_len] = True
            mask[row, text_len - suffix_len :] = True
        inputs["encoder_attention_mask"] = mask
    return inputs


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).norm() / ref.double().norm()).item()


CASES = {
    "b2_unequal_mid_padding": (2, 11, (5, 7), [(3, 2), (6, 2)]),
    "b1_mid_padding": (1, 11, (5, 7), [(4, 2)]),
    "b2_no_mask": (2, 6, (3, 5), None),
    "b2_equal_lengths_different_layout": (2, 10, (4, 3), [(2, 3), (4, 1)]),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def model_pair(request):
    reference = reference_model(CONFIGS[request.param])
    return reference, native_copy(reference)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@torch.no_grad()
def test_forward_matches_diffusers(model_pair, case):
    reference, ours = model_pair
    inputs = make_inputs(*CASES[case])
    expected = reference(**inputs, return_dict=False)[0]
    assert expected.std() > 0.1  # a non-trivial output, so a small relative error means something
    assert rel_err(ours(**inputs), expected) <= 1e-5


@torch.no_grad()
def test_encode_text_once_then_forward_equals_raw_forward():
    ours = native_copy(reference_model(CONFIGS["gqa2_depth2"]))
    inputs = make_inputs(2, 11, (5, 7), [(3, 2), (6, 2)])
    text = ours.encode_text(inputs["encoder_hidden_states"], inputs["encoder_attention_mask"])
    assert text.tokens.shape == (2, 8, ours.hidden_size)  # longest row: 6 + 2 real tokens
    assert text.key_mask.tolist() == [[True] * 5 + [False] * 3, [True] * 8]
    raw = ours(**inputs)
    conditioned = ours(**{**inputs, "encoder_hidden_states": text, "encoder_attention_mask": None})
    torch.testing.assert_close(conditioned, raw, rtol=0, atol=1e-6)

    single = ours.encode_text(inputs["encoder_hidden_states"][:1], inputs["encoder_attention_mask"][:1])
    assert single.key_mask is None and single.num_tokens == 5  # batch 1: padding dropped, no mask at all


@torch.no_grad()
def test_concatenated_conditionings_match_separate_calls():
    """Batched CFG: cond and uncond of different lengths in one batch give each row's own result."""
    ours = native_copy(reference_model(CONFIGS["gqa4_depth3"]))
    inputs = make_inputs(2, 11, (5, 7), [(6, 2), (0, 2)])
    ehs, mask = inputs["encoder_hidden_states"], inputs["encoder_attention_mask"]
    parts = [ours.encode_text(ehs[i : i + 1], mask[i : i + 1]) for i in range(2)]
    batched = ours(**{**inputs, "encoder_hidden_states": TextConditioning.concat(parts)})
    for i, part in enumerate(parts):
        alone = ours(inputs["hidden_states"][i : i + 1], part, inputs["timestep"][i : i + 1], inputs["position_ids"])
        torch.testing.assert_close(batched[i : i + 1], alone, rtol=0, atol=1e-5)


def test_pack_valid_tokens_keeps_order_and_drops_middle_padding():
    x = torch.arange(2 * 6).reshape(2, 6)
    valid = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    packed, key_mask = pack_valid_tokens(x, valid)
    assert packed.tolist() == [[0, 3, 4], [6, 7, 11]] and key_mask is None  # equal valid lengths: no mask
    valid[1, 1] = False
    packed, key_mask = pack_valid_tokens(x, valid)
    assert packed[0].tolist() == [0, 3, 4] and packed[1, :2].tolist() == [6, 11]
    assert key_mask.tolist() == [[True, True, True], [True, True, False]]


@torch.no_grad()
def test_return_conventions_and_config():
    ours = native_copy(reference_model(CONFIGS["gqa1_depth1"]))
    inputs = make_inputs(1, 7, (2, 3), [(3, 2)])
    velocity = ours(**inputs)
    assert velocity.shape == (1, 6, IN_CHANNELS)
    (as_tuple,) = ours(**inputs, return_dict=False)
    torch.testing.assert_close(as_tuple, velocity)
    torch.testing.assert_close(ours(**inputs, return_dict=True).sample, velocity)
    assert ours.config["num_layers"] == 1 and ours.config.in_channels == IN_CHANNELS


def test_default_config_is_the_released_model_with_identical_state_dict():
    with torch.device("meta"):  # 12.8 B parameters: shapes only
        ours, reference = Krea2Transformer(), Krea2Transformer2DModel()
    assert ours.config["axes_dims_rope"] == (32, 48, 48) and len(ours.transformer_blocks) == 28
    assert sum(p.numel() for p in ours.parameters()) == 12_820_073_036
    shapes = {key: tuple(value.shape) for key, value in ours.state_dict().items()}
    assert shapes == {key: tuple(value.shape) for key, value in reference.state_dict().items()}


@torch.no_grad()
def test_forward_routes_through_run_blocks_seam():
    ours = native_copy(reference_model(CONFIGS["gqa2_depth2"]))
    inputs = make_inputs(2, 11, (5, 7), [(3, 2), (6, 2)])
    expected = ours(**inputs)

    seen = []

    def spy(hidden_states, *block_args):
        seen.append(block_args)
        return type(ours).run_blocks(ours, hidden_states, *block_args)

    ours.run_blocks = spy
    torch.testing.assert_close(ours(**inputs), expected, rtol=0, atol=0)
    (block_args,) = seen
    temb_mod, (cos, sin), key_mask = block_args  # positional: temb_mod, rotary_emb, attention_mask
    assert temb_mod.shape == (2, 1, 6 * ours.hidden_size)
    assert cos.shape == sin.shape == (8 + 35, 8) and key_mask.shape == (2, 8 + 35)

    ours.run_blocks = lambda hidden_states, *block_args: hidden_states  # skip every block
    assert rel_err(ours(**inputs), expected) > 0.1


@torch.no_grad()
def test_blocks_and_forward_do_not_modify_inputs():
    ours = native_copy(reference_model(CONFIGS["gqa2_depth2"]))
    inputs = make_inputs(2, 11, (5, 7), [(3, 2), (6, 2)])
    before = {k: v.clone() for k, v in inputs.items() if v is not None}
    ours(**inputs)
    for key, value in before.items():
        assert torch.equal(inputs[key], value), key

    hidden = torch.randn(2, 43, ours.hidden_size)
    temb_mod = torch.randn(2, 1, 6 * ours.hidden_size)
    rope = ours.rotary_emb(torch.ones(35, 3), num_leading_zeros=8)
    mask = torch.ones(2, 43, dtype=torch.bool)
    mask[0, 5:8] = False
    snapshot = [t.clone() for t in (hidden, temb_mod, *rope, mask)]
    out = ours.transformer_blocks[0](hidden, temb_mod, rope, mask)
    assert not torch.equal(out, hidden)
    for original, now in zip(snapshot, (hidden, temb_mod, *rope, mask)):
        assert torch.equal(original, now)


def test_block_traces_without_graph_breaks():
    ours = Krea2Transformer(**CONFIGS["gqa2_depth2"]).eval()
    block = ours.transformer_blocks[0]
    hidden = torch.randn(2, 10, ours.hidden_size)
    temb_mod = torch.randn(2, 1, 6 * ours.hidden_size)
    rope = ours.rotary_emb(torch.ones(6, 3), num_leading_zeros=4)
    for mask in (None, torch.rand(2, 10) > 0.3):
        explanation = torch._dynamo.explain(block)(hidden, temb_mod, rope, mask)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1


# ---------------------------------------------------------------------------------------------------------------------
# checkpoints


@pytest.fixture(scope="module")
def saved_pipeline(tmp_path_factory):
    """A diffusers-layout pipeline folder whose `transformer/` holds a sharded checkpoint written by diffusers."""
    root = tmp_path_factory.mktemp("krea2")
    reference = reference_model(CONFIGS["gqa2_depth2"], seed=3)
    reference.save_pretrained(root / "transformer", max_shard_size="40KB")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Krea2Pipeline"}))
    shards = sorted((root / "transformer").glob("*.safetensors"))
    assert len(shards) > 2 and (root / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    return root, reference


@torch.no_grad()
def test_from_pretrained_sharded_diffusers_checkpoint(saved_pipeline):
    root, reference = saved_pipeline
    inputs = make_inputs(2, 11, (5, 7), [(3, 2), (6, 2)])
    expected = reference(**inputs, return_dict=False)[0]
    for model in (
        Krea2Transformer.from_pretrained(root),  # pipeline folder, default subfolder "transformer"
        Krea2Transformer.from_pretrained(root / "transformer", subfolder=None),
    ):
        assert not model.training and model.dtype == torch.float32
        assert rel_err(model(**inputs), expected) <= 1e-5


@torch.no_grad()
def test_from_pretrained_bf16_keeps_norm_weights_fp32(saved_pipeline):
    root, reference = saved_pipeline
    model = Krea2Transformer.from_pretrained(root, dtype=torch.bfloat16)
    norm_names = {name for name, _ in model.named_parameters() if keeps_fp32(name)}
    assert norm_names == {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, RMSNorm)}
    for name, param in model.named_parameters():
        assert param.dtype == (torch.float32 if name in norm_names else torch.bfloat16), name
    assert "transformer_blocks.0.attn.norm_q.weight" in norm_names and "txt_in.norm.weight" in norm_names

    cast = native_copy(reference).to_dtype(torch.bfloat16)
    assert {n: p.dtype for n, p in cast.named_parameters()} == {n: p.dtype for n, p in model.named_parameters()}

    inputs = make_inputs(1, 11, (5, 7), [(4, 2)])
    expected = reference(**inputs, return_dict=False)[0]
    velocity = model(**{**inputs, "hidden_states": inputs["hidden_states"].bfloat16()})
    assert velocity.dtype == torch.bfloat16
    assert rel_err(velocity, expected) < 0.05  # bf16 rounding only


def _copy_checkpoint(root, tmp_path):
    target = tmp_path / "transformer"
    target.mkdir()
    for file in (root / "transformer").iterdir():
        target.joinpath(file.name).write_bytes(file.read_bytes())
    index = json.loads((target / "diffusion_pytorch_model.safetensors.index.json").read_text())
    return target, index["weight_map"]


def test_missing_shard_is_named(saved_pipeline, tmp_path):
    target, weight_map = _copy_checkpoint(saved_pipeline[0], tmp_path)
    shard = weight_map["final_layer.linear.weight"]
    (target / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"missing shard {shard}.*index\.json"):
        Krea2Transformer.from_pretrained(tmp_path)


@pytest.mark.parametrize("defect", ["wrong_shape", "unknown_key"])
def test_bad_tensor_is_named_with_shapes(saved_pipeline, tmp_path, defect):
    target, weight_map = _copy_checkpoint(saved_pipeline[0], tmp_path)
    key = "transformer_blocks.1.attn.to_k.weight"
    shard = target / weight_map[key]
    tensors = load_file(shard)
    if defect == "wrong_shape":
        tensors[key] = torch.zeros(16, 64)
        pattern = rf"{key} \(expected \(32, 64\), found \(16, 64\)\)"
    else:
        tensors["transformer_blocks.9.attn.to_k.weight"] = torch.zeros(32, 64)
        pattern = r"unknown key\(s\).*transformer_blocks\.9\.attn\.to_k\.weight"
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=pattern) as info:
        Krea2Transformer.from_pretrained(tmp_path)
    assert str(target) in str(info.value)


def test_unknown_config_key_is_named(saved_pipeline, tmp_path):
    target, _ = _copy_checkpoint(saved_pipeline[0], tmp_path)
    config = json.loads((target / "config.json").read_text())
    assert config["_class_name"] == "Krea2Transformer2DModel"  # diffusers-only keys are ignored ...
    config["num_single_layers"] = 4  # ... architecture keys we do not know are not
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: unknown config key\(s\) num_single_layers"):
        Krea2Transformer.from_pretrained(tmp_path)


def test_rope_rotates_each_channel_pair_with_the_bits_of_the_pairwise_formula():
    from dicache.models.krea2.transformer import apply_rope

    g = torch.Generator().manual_seed(5)
    angles = torch.rand(7, 4, generator=g) * 6.28
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 7, 3, 8, generator=g).to(dtype)
        re, im = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        pairwise = torch.stack((re * cos - im * sin, im * cos + re * sin), dim=-1).flatten(-2).to(dtype)
        got = apply_rope(x, angles.cos(), angles.sin())
        assert torch.equal(got, pairwise)
        back = apply_rope(got.float(), (-angles).cos(), (-angles).sin())  # rotating back restores x
        torch.testing.assert_close(back, x.float(), rtol=0.02 if dtype == torch.bfloat16 else 1e-5, atol=0.02)


def test_rotary_tables_give_the_per_axis_formula_bitwise():
    """The frequency and axis tables are made once per device; a call gives exactly the per-axis angles
    `position[axis] * theta ** (-2i / dim)` in float64, padded with identity rows for the text tokens."""
    from dicache.models.krea2.transformer import RotaryEmbedding

    rope = RotaryEmbedding(1000.0, (4, 6, 6))
    positions = torch.randint(0, 70, (23, 3)).float()
    columns = []
    for axis, dim in enumerate((4, 6, 6)):
        inv_freq = 1.0 / 1000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        columns.append(positions[:, axis].double()[:, None] * inv_freq)
    angles = torch.cat([torch.zeros(5, 8, dtype=torch.float64), torch.cat(columns, dim=-1)])
    for _ in range(2):  # the second call reads the tables made by the first
        cos, sin = rope(positions, num_leading_zeros=5)
        assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())
    assert list(rope._tables) == [torch.device("cpu")]


def test_time_embedding_sinusoids_are_the_formula():
    from dicache.models.krea2.transformer import TimestepEmbedding

    embedding = TimestepEmbedding(8, 6)
    t = torch.tensor([0.25, 0.9])
    freqs = torch.exp(torch.arange(4, dtype=torch.float32) * (-math.log(1e4) / 4))
    angles = (t * 1000.0)[:, None, None] * freqs
    expected = embedding.linear_2(
        F.gelu(embedding.linear_1(torch.cat([angles.cos(), angles.sin()], -1)), approximate="tanh")
    )
    for _ in range(2):
        assert torch.equal(embedding(t, torch.float32), expected)
