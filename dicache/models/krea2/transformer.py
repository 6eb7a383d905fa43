"""Native Krea-2 transformer: a single-stream MMDiT over the joint sequence `[text tokens, image tokens]`.

Parameter names and config keys equal diffusers' `Krea2Transformer2DModel`, so a released `transformer/` folder
(config.json + sharded safetensors) loads without remapping. Outputs equal the reference within float noise, while
taking three exact savings:

- padded text tokens are dropped, not masked (batch 1: no mask at all; batch > 1: each row padded to the batch's
  longest valid length and only that remainder masked as keys);
- text fusion + `txt_in` run once per request and CFG branch (`encode_text`), not at every step;
- grouped-query attention goes to SDPA with `enable_gqa` (no K/V repetition, fast kernels), see `attention.py`.

The cache engine's seam is `Krea2Transformer.run_blocks`: the only place the block stack is run.
Parallel layouts (`dicache.parallel`) use neutral seams that are identities here: `Krea2Transformer.shard_image` /
`gather_image` (which image tokens this process computes) and `Attention.kernel` (the attention call). A block's
`token_rows` gives the arguments computing a subset of its rows as queries (the other rows' keys and values then come
through `Attention.kernel`), the seam of `cached_step_method=tokens`.
"""

from __future__ import annotations

import inspect
import math
import os
import pathlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dicache.models.krea2.attention import gqa_attention, shape_free_attention
from dicache.models.loading import CheckpointError, load_component
from dicache.quantization.joint_linears import linear_outputs

# Submodule names whose weights stay float32 when the model runs in bf16/fp16 (diffusers' `_keep_in_fp32_modules`).
FP32_MODULE_NAMES = frozenset({"norm", "norm1", "norm2", "norm_q", "norm_k"})


def keeps_fp32(param_name: str) -> bool:
    """True for parameters kept in float32 whatever the model dtype: the RMSNorm weights."""
    return not FP32_MODULE_NAMES.isdisjoint(param_name.split(".")[:-1])


# ---------------------------------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with scale `1 + weight` (zero-centred, as stored in the checkpoint).

    Computed in float32 whatever the input dtype; returns the input dtype.
    """

    zero_centred_gain = True  # the identity scale is weight = 0 (random weights for measurements use it)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (self.dim,), self.weight.float() + 1.0, self.eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs `(2i, 2i+1)` of `x` `(B, S, H, D)` by the angles of `cos`/`sin` `(S, D/2)`.

    Computed in float32, returned in `x`'s dtype. Written as `x * cos' + swap_pairs(x) * sin'` (cos' and sin' each
    angle's value twice, sin' negated on even channels): the same products and sums as the pairwise form
    `(re cos - im sin, im cos + re sin)`, so the same bits in eager, and one elementwise pass with no stacking when
    compiled (benchmarks/RESULTS.md 2026-11-30, `probe_forward_time.py` "qk": 0.78 against 0.82 ms with attention).
    """
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
    cos2 = cos.repeat_interleave(2, dim=-1)[:, None, :]
    sin2 = torch.stack((-sin, sin), dim=-1).flatten(-2)[:, None, :]
    return (xf * cos2 + swapped * sin2).to(x.dtype)


class Attention(nn.Module):
    """Self-attention: GQA projections, q/k RMSNorm, optional RoPE, sigmoid-gated output.

    `to_out` is a one-element list only so the checkpoint key reads `to_out.0.weight`. `kernel` is the attention
    seam, `(q, k, v, key_mask) -> out` in `gqa_attention`'s layout; a parallel layout may replace it on an instance
    (e.g. to exchange heads for sequence around it). `num_heads` / `num_kv_heads` are the heads this module computes.
    """

    kernel = staticmethod(gqa_attention)
    joinable = (("to_q", "to_gate"), ("to_k", "to_v"))
    """Projections of one input that `joint_linears.join_linears` may run as one GEMM each."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, eps: float) -> None:
        super().__init__()
        if dim % num_heads != 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"need dim % num_heads == 0 and num_heads % num_kv_heads == 0, got {dim}/{num_heads}/{num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = dim // num_heads
        self.to_q = nn.Linear(dim, num_heads * self.head_dim, bias=False)
        self.to_k = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.to_v = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.to_gate = nn.Linear(dim, dim, bias=False)
        self.norm_q = RMSNorm(self.head_dim, eps)
        self.norm_k = RMSNorm(self.head_dim, eps)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: `(B, S, dim)`; rope: `(cos, sin)` each `(S, head_dim/2)` float32; key_mask: `(B, S)` bool or None."""
        q, k, v, gate = linear_outputs(self, x, ("to_q", "to_k", "to_v", "to_gate"))
        q = self.norm_q(q.unflatten(-1, (self.num_heads, self.head_dim)))
        k = self.norm_k(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        # contiguous: a joined projection's value is a view of its output, and cuDNN's plan shared across lengths
        # needs q, k, v laid out (B, S, H, D) (`attention_plans`); q and k are new tensors from the norms already
        v = v.contiguous().unflatten(-1, (self.num_kv_heads, self.head_dim))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), key_mask)
        out = out.transpose(1, 2).flatten(2)
        return self.to_out[0](out * torch.sigmoid(gate))


class SwiGLU(nn.Module):
    """Feed-forward `down(silu(gate(x)) * up(x))`, no biases."""

    joinable = (("gate", "up"),)
    """Projections of one input that `joint_linears.join_linears` may run as one GEMM."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden_dim, bias=False)
        self.up = nn.Linear(dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear_outputs(self, x, ("gate", "up"))
        return self.down(F.silu(gate) * up)


# ---------------------------------------------------------------------------------------------------------------------
# text path: tapped encoder layers -> fused tokens -> transformer width


class TextFusionBlock(nn.Module):
    """Pre-norm transformer block of the text fusion stage: no RoPE, no time modulation. Its attention runs on the
    shape-free SDPA backends (`shape_free_attention`): its shapes follow the prompt length."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, intermediate_size: int, eps: float) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim, eps)
        self.attn = Attention(dim, num_heads, num_kv_heads, eps)
        self.attn.kernel = shape_free_attention
        self.norm2 = RMSNorm(dim, eps)
        self.ff = SwiGLU(dim, intermediate_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), key_mask=key_mask)
        return x + self.ff(self.norm2(x))


class TextFusion(nn.Module):
    """`(B, T, num_text_layers, dim)` tapped encoder states -> `(B, T, dim)` text features.

    `layerwise_blocks` attend across the tapped-layer axis of each token on its own, `projector` (a learned weighting
    of the layers) collapses that axis, `refiner_blocks` attend across the tokens.
    """

    def __init__(
        self,
        num_text_layers: int,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate_size: int,
        num_layerwise_blocks: int,
        num_refiner_blocks: int,
        eps: float,
    ) -> None:
        super().__init__()
        self.layerwise_blocks = nn.ModuleList(
            TextFusionBlock(dim, num_heads, num_kv_heads, intermediate_size, eps) for _ in range(num_layerwise_blocks)
        )
        self.projector = nn.Linear(num_text_layers, 1, bias=False)
        self.refiner_blocks = nn.ModuleList(
            TextFusionBlock(dim, num_heads, num_kv_heads, intermediate_size, eps) for _ in range(num_refiner_blocks)
        )

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """key_mask: `(B, T)` bool, True for real tokens; a row with none is left unmasked (its tokens are unused)."""
        batch, tokens, layers, dim = x.shape
        per_token = x.reshape(batch * tokens, layers, dim)
        for block in self.layerwise_blocks:
            per_token = block(per_token)
        x = torch.einsum("btld,l->btd", per_token.reshape(batch, tokens, layers, dim), self.projector.weight[0])
        if key_mask is not None:
            key_mask = key_mask | ~key_mask.any(dim=1, keepdim=True)  # an all-masked row would give NaN
        for block in self.refiner_blocks:
            x = block(x, key_mask)
        return x


class TextProjection(nn.Module):
    """Fused text features `(B, T, text_dim)` -> transformer width: RMSNorm, linear, GELU(tanh), linear."""

    def __init__(self, text_dim: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(text_dim, eps)
        self.linear_1 = nn.Linear(text_dim, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(self.norm(x)), approximate="tanh"))


@dataclass(frozen=True)
class TextConditioning:
    """Text tokens ready to join the image tokens; depends on the prompt only, so compute once per request and branch.

    tokens: `(B, T, hidden_size)` in the model dtype, the projected real text tokens of each row in prompt order
        (rows shorter than `T` are padded at the end).
    key_mask: `(B, T)` bool, True for real tokens; None when every row has `T` real tokens (always so for batch 1).
    """

    tokens: torch.Tensor
    key_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def concat(cls, items: list[TextConditioning]) -> TextConditioning:
        """Stack along the batch axis (e.g. cond + uncond for batched CFG), padding to the longest and masking."""
        longest = max(item.num_tokens for item in items)
        if all(item.key_mask is None and item.num_tokens == longest for item in items):
            return cls(torch.cat([item.tokens for item in items]))
        tokens, masks = [], []
        for item in items:
            pad = longest - item.num_tokens
            mask = item.key_mask
            if mask is None:
                mask = torch.ones(item.tokens.shape[:2], dtype=torch.bool, device=item.tokens.device)
            tokens.append(F.pad(item.tokens, (0, 0, 0, pad)))
            masks.append(F.pad(mask, (0, pad), value=False))
        return cls(torch.cat(tokens), torch.cat(masks))


def pack_valid_tokens(x: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keep the valid tokens of `x` `(B, T, ...)` in order, dropping padding wherever it sits.

    valid: `(B, T)` bool or None (all valid). Returns `(packed (B, T', ...), key_mask (B, T') or None)`: with one row,
    or rows of equal valid length, `T'` is that length and no mask is needed; otherwise `T'` is the longest valid
    length and `key_mask` marks each row's real tokens (the remainder holds padding tokens, never attended to).
    The mask is read where it lies: a mask on the host costs no synchronisation with `x`'s device (the indices are
    queued to it behind its work, e.g. a text encoder still running); a mask on the device costs one. Call it once
    per request, not per step.
    """
    if valid is None:
        return x, None
    valid = valid.to(torch.bool)
    if valid.shape[0] == 1:
        return x[:, _queued_to(valid[0].nonzero().squeeze(1), x.device)], None
    lengths = valid.sum(dim=1)
    longest = int(lengths.max())
    # A stable sort on "is padding" puts each row's valid positions first, in their original order.
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :longest]
    rows = torch.arange(x.shape[0], device=valid.device)[:, None]
    packed = x[_queued_to(rows, x.device), _queued_to(order, x.device)]
    key_mask = torch.arange(longest, device=valid.device)[None, :] < lengths[:, None]
    return packed, (None if bool(key_mask.all()) else _queued_to(key_mask, x.device))


def _queued_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from the host, a copy queued on the device's current stream without waiting for it
    (a pageable source is staged before the call returns, so the host tensor may go away at once)."""
    return tensor.to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------------------------------------
# image path: time conditioning, RoPE, blocks, output


class TimestepEmbedding(nn.Module):
    """Flow time `t` in [0, 1] `(B,)` -> `(B, 1, hidden_size)`: sinusoids of `1000 t` (cos half first), then an MLP."""

    def __init__(self, embed_dim: int, hidden_size: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.linear_1 = nn.Linear(embed_dim, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)
        self._freqs: dict[torch.device, torch.Tensor] = {}  # the sinusoid frequencies, made once per device

    def frequencies(self, device: torch.device) -> torch.Tensor:
        """`exp(-ln(1e4) i / half)`, `i < half = embed_dim // 2`, float32 `(half,)` on `device` (made on first use:
        three launches fewer per call)."""
        freqs = self._freqs.get(device)
        if freqs is None:
            half = self.embed_dim // 2
            freqs = torch.exp(torch.arange(half, dtype=torch.float32, device=device) * (-math.log(1e4) / half))
            self._freqs[device] = freqs
        return freqs

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        angles = (timestep.float() * 1000.0)[:, None, None] * self.frequencies(timestep.device)
        sinusoids = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)
        return self.linear_2(F.gelu(self.linear_1(sinusoids), approximate="tanh"))


class RotaryEmbedding(nn.Module):
    """3-axis RoPE tables: per axis `a` of `axes_dim`, frequencies `theta ** (-2i / axes_dim[a])`, `i < axes_dim[a]/2`.

    No parameters. Angles are computed in float64 (float32 on MPS) and returned as float32 `(cos, sin)`.
    """

    def __init__(self, theta: float, axes_dim: tuple[int, ...]) -> None:
        super().__init__()
        self.theta, self.axes_dim = theta, tuple(axes_dim)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # made once per device

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The frequency of each output column and the axis it reads: `(sum(axes_dim)/2,)` each, float64 (float32 on
        MPS) and int64 on `device`. Made on first use, so that a call is a handful of launches, not three per axis."""
        tables = self._tables.get(device)
        if tables is None:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            inv_freq = torch.cat(
                [
                    1.0 / self.theta ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim)
                    for dim in self.axes_dim
                ]
            )
            axis = torch.cat([torch.full((dim // 2,), a, device=device) for a, dim in enumerate(self.axes_dim)])
            tables = self._tables[device] = (inv_freq, axis)
        return tables

    def forward(self, positions: torch.Tensor, num_leading_zeros: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: `(N, num_axes)`. Returns `(cos, sin)`, each `(num_leading_zeros + N, sum(axes_dim)/2)`; the
        leading rows are position 0 on every axis (identity rotation), used for the text tokens."""
        inv_freq, axis = self.tables(positions.device)
        angles = positions.to(inv_freq.dtype).index_select(1, axis) * inv_freq
        angles = F.pad(angles, (0, 0, num_leading_zeros, 0))
        return angles.cos().float(), angles.sin().float()


class Krea2TransformerBlock(nn.Module):
    """One block of the stack. Time modulation = the shared `temb_mod` + this block's `scale_shift_table`.

    `forward(hidden_states, temb_mod, rotary_emb, attention_mask=None) -> hidden_states`, all positional-friendly:
    hidden_states `(B, S, hidden)`; temb_mod `(B, 1, 6*hidden)`; rotary_emb `(cos, sin)` `(S, head_dim/2)` float32;
    attention_mask `(B, S)` bool key mask or None. Never modifies its inputs in place.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, eps: float) -> None:
        super().__init__()
        # rows: attention (scale, shift, gate), feed-forward (scale, shift, gate)
        self.scale_shift_table = nn.Parameter(torch.zeros(6, hidden_size))
        self.norm1 = RMSNorm(hidden_size, eps)
        self.attn = Attention(hidden_size, num_heads, num_kv_heads, eps)
        self.norm2 = RMSNorm(hidden_size, eps)
        self.ff = SwiGLU(hidden_size, intermediate_size)

    @staticmethod
    def token_rows(
        rows: torch.Tensor,
        hidden_states: torch.Tensor,
        temb_mod: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
    ) -> tuple:
        """Sequence seam: the arguments that compute only the joint-sequence rows `rows` `(k,)` int64 as queries,
        against keys from every row. `hidden_states` are those rows' `(B, k, C)` (already cut); the RoPE tables are
        cut to `rows`; the time modulation and the key mask (over all keys) stay. Keys and values of the other rows
        come through the attention's `kernel`, which gets this key mask unchanged; the block is the same code."""
        cos, sin = rotary_emb
        return hidden_states, temb_mod, (cos.index_select(0, rows), sin.index_select(0, rows)), attention_mask

    def forward(
        self,
        hidden_states: torch.Tensor,
        temb_mod: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        modulation = temb_mod.unflatten(-1, (6, -1)) + self.scale_shift_table
        attn_scale, attn_shift, attn_gate, ff_scale, ff_shift, ff_gate = modulation.unbind(-2)
        attn_in = (1.0 + attn_scale) * self.norm1(hidden_states) + attn_shift
        hidden_states = hidden_states + attn_gate * self.attn(attn_in, rotary_emb, attention_mask)
        ff_in = (1.0 + ff_scale) * self.norm2(hidden_states) + ff_shift
        return hidden_states + ff_gate * self.ff(ff_in)


class FinalLayer(nn.Module):
    """Modulated RMSNorm (`scale_shift_table` rows: scale, shift) + projection to the latent channels."""

    def __init__(self, hidden_size: int, out_channels: int, eps: float) -> None:
        super().__init__()
        self.scale_shift_table = nn.Parameter(torch.zeros(2, hidden_size))
        self.norm = RMSNorm(hidden_size, eps)
        self.linear = nn.Linear(hidden_size, out_channels)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = (temb + self.scale_shift_table).split(1, dim=1)  # (B, 1, hidden) each
        return self.linear((1.0 + scale) * self.norm(x) + shift)


@dataclass
class Krea2TransformerOutput:
    """What `forward(..., return_dict=True)` returns, mirroring diffusers' `Transformer2DModelOutput`."""

    sample: torch.Tensor


class ModelConfig(dict):
    """The constructor arguments; readable as `config["key"]` or `config.key` (as diffusers pipelines do)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


# ---------------------------------------------------------------------------------------------------------------------
# the model


class Krea2Transformer(nn.Module):
    """Krea-2 velocity model. Defaults are the released 12.8 B configuration (28 blocks, width 6144, 48/12 heads).

    Width = `attention_head_dim * num_attention_heads`; `sum(axes_dims_rope)` must equal `attention_head_dim`.
    """

    def __init__(
        self,
        in_channels: int = 64,
        num_layers: int = 28,
        attention_head_dim: int = 128,
        num_attention_heads: int = 48,
        num_key_value_heads: int = 12,
        intermediate_size: int = 16384,
        timestep_embed_dim: int = 256,
        text_hidden_dim: int = 2560,
        num_text_layers: int = 12,
        text_num_attention_heads: int = 20,
        text_num_key_value_heads: int = 20,
        text_intermediate_size: int = 6912,
        num_layerwise_text_blocks: int = 2,
        num_refiner_text_blocks: int = 2,
        axes_dims_rope: tuple[int, int, int] = (32, 48, 48),
        rope_theta: float = 1000.0,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        axes_dims_rope = tuple(axes_dims_rope)
        self.config = ModelConfig(
            (name, value) for name, value in locals().items() if name not in ("self", "__class__")
        )
        if sum(axes_dims_rope) != attention_head_dim:
            raise ValueError(
                f"sum(axes_dims_rope)={sum(axes_dims_rope)} must equal attention_head_dim={attention_head_dim}"
            )
        hidden_size = attention_head_dim * num_attention_heads
        self.in_channels = self.out_channels = in_channels
        self.hidden_size = hidden_size

        self.img_in = nn.Linear(in_channels, hidden_size)
        self.time_embed = TimestepEmbedding(timestep_embed_dim, hidden_size)
        self.time_mod_proj = nn.Linear(hidden_size, 6 * hidden_size)
        self.text_fusion = TextFusion(
            num_text_layers=num_text_layers,
            dim=text_hidden_dim,
            num_heads=text_num_attention_heads,
            num_kv_heads=text_num_key_value_heads,
            intermediate_size=text_intermediate_size,
            num_layerwise_blocks=num_layerwise_text_blocks,
            num_refiner_blocks=num_refiner_text_blocks,
            eps=norm_eps,
        )
        self.txt_in = TextProjection(text_hidden_dim, hidden_size, norm_eps)
        self.rotary_emb = RotaryEmbedding(rope_theta, axes_dims_rope)
        self.transformer_blocks = nn.ModuleList(
            Krea2TransformerBlock(hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, norm_eps)
            for _ in range(num_layers)
        )
        self.final_layer = FinalLayer(hidden_size, in_channels, norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the linear weights; RMSNorm weights may stay float32)."""
        return self.img_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    def to_dtype(self, dtype: torch.dtype) -> Krea2Transformer:
        """Cast floating parameters to `dtype` in place, keeping the RMSNorm weights float32 (see `keeps_fp32`).

        Use this rather than `.to(dtype)`, which would also cast the norm weights.
        """
        for name, param in self.named_parameters():
            target = torch.float32 if keeps_fp32(name) else dtype
            if param.is_floating_point() and param.dtype != target:
                param.data = param.data.to(target)
        return self

    def block_names(self) -> list[str]:
        """The qualified names of the blocks, in order: `transformer_blocks.<i>`."""
        return [f"transformer_blocks.{i}" for i in range(len(self.transformer_blocks))]

    def compile_blocks(
        self, *, fullgraph: bool = True, dynamic: bool | None = None, backend: str = "inductor"
    ) -> Krea2Transformer:
        """`torch.compile` each transformer block in place (the block stack's loop, the cache engine's seam and the
        embeddings stay eager). All blocks share one compiled graph (regional compilation: the 28 blocks are one
        module class, their weights graph inputs). With `dynamic=None` the joint sequence's length is symbolic from
        the first call (`mark_sequence_dynamic`): one graph serves every prompt length and image size, where
        dynamo's automatic dynamic shapes compiled the first shape static and again, symbolic, at the second (two
        compiles of the largest graph at start-up). `dynamic=False`: a graph per shape. Raises the dynamo recompile
        limit to cover one entry per block."""
        self.recompile_limit = 4 * len(self.transformer_blocks)
        self.apply_compile_settings()
        for block in self.transformer_blocks:
            block.compile(fullgraph=fullgraph, dynamic=dynamic, backend=backend)
        self.compiled = True
        self.sequence_dynamic = dynamic is None
        return self

    def mark_sequence_dynamic(self, hidden_states: torch.Tensor, rotary_emb: tuple[torch.Tensor, ...]) -> None:
        """With blocks compiled by `compile_blocks(dynamic=None)`: the blocks' inputs of one call, the joint sequence
        `(B, n, C)` and the RoPE tables `(n, d)`, get their length `n` marked symbolic for dynamo (a length it must
        specialise stays static: no error). Nothing otherwise."""
        if not getattr(self, "sequence_dynamic", False):
            return
        import torch._dynamo  # seconds to import: only compiled blocks get here

        torch._dynamo.maybe_mark_dynamic(hidden_states, 1)
        for table in rotary_emb:
            torch._dynamo.maybe_mark_dynamic(table, 0)

    def apply_compile_settings(self) -> None:
        """Raise the calling thread's dynamo recompile limit to `recompile_limit` (set by `compile_blocks`; nothing
        before). torch.compile's settings are per thread from torch 2.12 on, so every thread that runs the compiled
        blocks calls this first (the server's denoising thread does)."""
        limit = getattr(self, "recompile_limit", None)
        if limit is None:
            return
        import torch._dynamo  # seconds to import: only compiling needs it

        config = torch._dynamo.config
        limit_name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        if getattr(config, limit_name) < limit:
            setattr(config, limit_name, limit)

    # -- text -------------------------------------------------------------------------------------------------------

    def encode_text(
        self, encoder_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor | None = None
    ) -> TextConditioning:
        """Text fusion + `txt_in` over the real tokens only. Independent of the timestep: once per request and branch.

        encoder_hidden_states: `(B, T, num_text_layers, text_hidden_dim)` tapped text-encoder states;
        encoder_attention_mask: `(B, T)` bool, True for real tokens (padding may sit anywhere, e.g. mid-template).
        """
        tokens, key_mask = pack_valid_tokens(encoder_hidden_states, encoder_attention_mask)
        tokens = self.txt_in(self.text_fusion(tokens.to(self.dtype), key_mask))
        return TextConditioning(tokens, key_mask)

    @torch.no_grad()
    def prepare_text_lengths(self, image_positions: torch.Tensor, text_lengths: Iterable[int], batch: int = 1) -> int:
        """Run the first block once at each joint sequence length `n + N` (`n` in `text_lengths`, `N` image tokens
        at `image_positions` `(N, 3)`) on random inputs, so that set-up tied to the sequence length is done now
        rather than in a request: cuDNN's attention plan for the shape (50-75 ms each on an H200, kept per thread;
        the blocks share the shape, so one block stands for all). Run it on the thread that will denoise, after
        any compile warm-up (the compiled blocks then take a symbolic length). The longest length runs first: every
        later (shorter) call fits in the blocks the allocator keeps from it, whereas ascending lengths each asked for
        larger blocks than any cached one and grew the reserved memory by about 5 GB on an H200 at 1024², above the
        serving peak. Returns the number of lengths run."""
        image_positions = image_positions.to(self.device)
        timestep = torch.ones(batch, device=self.device)
        temb_mod = self.time_mod_proj(F.gelu(self.time_embed(timestep, self.dtype), approximate="tanh"))
        block, count = self.transformer_blocks[0], 0
        for n in sorted(text_lengths, reverse=True):
            rotary_emb = self.rotary_emb(image_positions, num_leading_zeros=n)
            joint = torch.randn(batch, n + image_positions.shape[0], self.hidden_size, device=self.device)
            joint = joint.to(self.dtype)
            self.mark_sequence_dynamic(joint, rotary_emb)
            block(joint, temb_mod, rotary_emb, None)
            count += 1
        return count

    # -- denoiser ---------------------------------------------------------------------------------------------------

    def shard_image(
        self, hidden_states: torch.Tensor, positions: torch.Tensor, num_text_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence seam: the image tokens `(B, n, C)` and their RoPE positions `(n, 3)` this process computes.

        The joint sequence the blocks see is `[text (num_text_tokens), these image tokens]`. Identity here (all `N`
        tokens); a sequence-parallel layout replaces it on the instance, together with `gather_image`.
        """
        return hidden_states, positions

    def gather_image(self, velocity: torch.Tensor) -> torch.Tensor:
        """Sequence seam: the velocity of all image tokens `(B, N, C)` from this process's share (identity here)."""
        return velocity

    def run_blocks(self, hidden_states: torch.Tensor, *block_args) -> torch.Tensor:
        """The block-stack seam (the cache engine replaces this on the instance). Keep it exactly this loop."""
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, *block_args)
        return hidden_states

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | TextConditioning,
        timestep: torch.Tensor,
        position_ids: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        attention_kwargs: dict | None = None,
        return_dict: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor] | Krea2TransformerOutput:
        """Flow-matching velocity of the image tokens.

        hidden_states: `(B, N, in_channels)` packed noisy latents.
        encoder_hidden_states: `(B, T, num_text_layers, text_hidden_dim)` tapped text-encoder states, or a
            `TextConditioning` from `encode_text` (then `encoder_attention_mask` is ignored).
        timestep: `(B,)` (or a scalar) flow time in [0, 1], 1 = pure noise.
        position_ids: `(T + N, 3)` `(t, h, w)` RoPE coordinates as diffusers' Krea-2 pipeline builds them; only the
            last `N` (image) rows are read: text rows are all zero there, and dropped padding does not change that.
        encoder_attention_mask: `(B, T)` bool, True for real text tokens; None = all real.
        attention_kwargs: accepted for signature compatibility; LoRA scaling is not supported.
        return_dict: None -> the velocity tensor; False -> `(velocity,)`; True -> `Krea2TransformerOutput`.

        Returns the velocity `(B, N, in_channels)` in the model dtype.
        """
        _reject_attention_kwargs(attention_kwargs)
        batch, image_len, _ = hidden_states.shape
        if position_ids.ndim != 2 or position_ids.shape[1] != 3 or position_ids.shape[0] < image_len:
            raise ValueError(f"position_ids must be (text_len + {image_len}, 3), got {tuple(position_ids.shape)}")
        text = encoder_hidden_states
        if not isinstance(text, TextConditioning):
            text = self.encode_text(text, encoder_attention_mask)
        if text.batch_size != batch:
            raise ValueError(f"text batch {text.batch_size} != image batch {batch}")
        if timestep.ndim == 0:
            timestep = timestep.expand(batch)

        temb = self.time_embed(timestep, self.dtype)
        temb_mod = self.time_mod_proj(F.gelu(temb, approximate="tanh"))
        image, image_positions = self.shard_image(hidden_states, position_ids[-image_len:], text.num_tokens)
        rotary_emb = self.rotary_emb(image_positions, num_leading_zeros=text.num_tokens)
        key_mask = text.key_mask
        if key_mask is not None:
            key_mask = torch.cat([key_mask, key_mask.new_ones(batch, image.shape[1])], dim=1)

        joint = torch.cat([text.tokens, self.img_in(image.to(self.dtype))], dim=1)
        self.mark_sequence_dynamic(joint, rotary_emb)
        joint = self.run_blocks(joint, temb_mod, rotary_emb, key_mask)
        velocity = self.gather_image(self.final_layer(joint[:, text.num_tokens :], temb))

        if return_dict is None:
            return velocity
        return Krea2TransformerOutput(velocity) if return_dict else (velocity,)

    # -- loading ----------------------------------------------------------------------------------------------------

    @classmethod
    def from_config_dict(cls, config: dict, *, source: str = "config") -> Krea2Transformer:
        """Build from a diffusers `config.json` dict (keys starting with `_` are ignored; unknown keys are errors)."""
        return cls(**_constructor_kwargs(cls, config, source))

    @classmethod
    def from_config(cls, config: dict, directory: os.PathLike) -> Krea2Transformer:
        """The model a component folder's parsed `config.json` describes (`directory`: that folder, for messages);
        its weights as the current device gives them (build it under `torch.device("meta")` to load them).
        `CheckpointError` for a key the constructor does not take."""
        return cls(**_constructor_kwargs(cls, config, str(pathlib.Path(directory) / "config.json")))

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | os.PathLike,
        subfolder: str | None = "transformer",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        load_format: str = "auto",
        on_block: Callable[[Krea2Transformer, str], None] | None = None,
        **hub_kwargs,
    ) -> Krea2Transformer:
        """Load a diffusers-layout checkpoint (`config.json` + safetensors, single or sharded) in eval mode.

        Built on the meta device and filled with tensors read straight onto `device` (default CPU), shards in
        parallel (`dicache.models.loading.load_streamed`). dtype default: bf16 on CUDA, fp32 otherwise; RMSNorm
        weights always fp32. `load_format="dummy"`: random weights from config.json alone (see `materialize_random`).
        `on_block(model, "transformer_blocks.<i>")` is called as soon as each block's weights are in place, while the
        next ones are read (e.g. to quantise it: the whole model never exists in bf16). `hub_kwargs` go to
        `resolve_component_dir` (cache_dir, revision, local_files_only). Errors: `CheckpointError` naming the file /
        key.
        """
        return load_component(
            path_or_repo_id,
            subfolder,
            cls.from_config,
            dtype=dtype,
            device=device,
            load_format=load_format,
            keep_fp32=keeps_fp32,
            parts=(lambda model: model.block_names()) if on_block is not None else (),
            on_part=on_block,
            **hub_kwargs,
        )


def _constructor_kwargs(cls: type, config: dict, source: str) -> dict:
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(key for key in config if not key.startswith("_") and key not in accepted)
    if unknown:
        raise CheckpointError(f"{source}: unknown config key(s) {', '.join(unknown)} for {cls.__name__}")
    return {key: value for key, value in config.items() if key in accepted}


def _reject_attention_kwargs(attention_kwargs: dict | None) -> None:
    if not attention_kwargs:
        return
    if set(attention_kwargs) == {"scale"} and attention_kwargs["scale"] == 1.0:
        return
    raise ValueError(f"attention_kwargs {sorted(attention_kwargs)} are not supported (no LoRA in the native model)")
