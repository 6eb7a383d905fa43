"""FLOPs estimate of a Krea-2 transformer call, counted from its config and token counts (pure functions).

Only matrix multiplications are counted (2 FLOPs per multiply-add); norms, RoPE, softmax and element-wise work are
ignored. A call = a fixed part (timestep MLP, `img_in`, final layer) + one term per block; the text path (text fusion
+ `txt_in`) is counted separately because pipelines differ in how often they run it: diffusers on every call, the
native pipeline once per request and CFG branch. The ratio is an estimate, not a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallFlops:
    """FLOPs of one transformer call: `per_block` for each of `num_blocks` blocks, `fixed` (embeddings, final layer)
    per call, and `text` per run of the text path."""

    per_block: float
    fixed: float
    text: float
    num_blocks: int

    @property
    def full(self) -> float:
        """One complete call, text path included."""
        return self.fixed + self.text + self.num_blocks * self.per_block


def _attention_block(tokens: int, keys: int, dim: int, heads: int, kv_heads: int, ffn: int) -> float:
    head_dim = dim // heads
    projections = 2 * tokens * dim * (3 * dim + 2 * kv_heads * head_dim)  # q, gate, out + k, v
    attention = 4 * tokens * keys * dim  # QK^T and AV over all heads
    mlp = 2 * tokens * 3 * dim * ffn  # SwiGLU gate, up, down
    return float(projections + attention + mlp)


def krea2_call_flops(config: Mapping[str, Any], image_tokens: int, text_tokens: int, batch: int = 1) -> CallFlops:
    """FLOPs of one call of a `Krea2Transformer2DModel`-style config (diffusers keys) on `batch` samples.

    `image_tokens`: packed latent tokens per sample; `text_tokens`: text tokens the blocks see per sample.
    """

    def get(key: str, default: Any = None) -> Any:
        value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
        if value is None:
            raise ValueError(f"transformer config has no {key!r}; cannot estimate FLOPs")
        return value

    dim = get("attention_head_dim", 128) * get("num_attention_heads", 48)
    tokens = image_tokens + text_tokens
    block = _attention_block(
        tokens, tokens, dim, get("num_attention_heads", 48), get("num_key_value_heads", 12), get("intermediate_size")
    )
    text_dim, layers = get("text_hidden_dim", 2560), get("num_text_layers", 12)
    text_block = dict(
        dim=text_dim,
        heads=get("text_num_attention_heads", 20),
        kv_heads=get("text_num_key_value_heads", 20),
        ffn=get("text_intermediate_size", 6912),
    )
    layerwise = get("num_layerwise_text_blocks", 2) * text_tokens * _attention_block(layers, layers, **text_block)
    refiner = get("num_refiner_text_blocks", 2) * _attention_block(text_tokens, text_tokens, **text_block)
    projector = 2 * text_tokens * text_dim * layers  # collapses the tapped-layer axis
    txt_in = 2 * text_tokens * (text_dim * dim + dim * dim)
    in_channels, time_dim = get("in_channels", 64), get("timestep_embed_dim", 256)
    embed = 2 * image_tokens * in_channels * dim + 2 * (time_dim * dim + dim * dim + 6 * dim * dim)
    final = 2 * image_tokens * dim * in_channels
    return CallFlops(
        per_block=batch * block,
        fixed=batch * float(embed + final),
        text=batch * float(layerwise + projector + refiner + txt_in),
        num_blocks=int(get("num_layers", 28)),
    )


def flops_ratio(
    call: CallFlops,
    calls: int,
    blocks_run: float,
    text_runs: int,
    full_calls: int | None = None,
    full_text_runs: int | None = None,
) -> float:
    """Estimated FLOPs of a generation / those of the uncached run of the same schedule; 1.0 when that has no calls.

    (blocks_run · per_block + calls · fixed + text_runs · text) / (full_calls · (num_blocks · per_block + fixed) +
    full_text_runs · text). `calls` / `text_runs`: transformer calls made and text-path runs of this generation;
    `full_calls` / `full_text_runs`: those of the uncached run (default: the same, i.e. a cache that changes only the
    blocks run). Only the blocks that ran are counted, so whole-step reuse (Fn = 0: a cached call runs no block) and
    baselines with fewer calls (fewer steps, step reuse) are in the same units; the fixed part is counted for every
    call made (an upper bound when a cached call skips the embeddings too).
    """
    full_calls = calls if full_calls is None else full_calls
    full_text_runs = text_runs if full_text_runs is None else full_text_runs
    if full_calls <= 0:
        return 1.0
    used = blocks_run * call.per_block + calls * call.fixed + text_runs * call.text
    full = full_calls * (call.num_blocks * call.per_block + call.fixed) + full_text_runs * call.text
    return used / full


def request_flops(
    config: Mapping[str, Any],
    image_tokens: int,
    text_tokens: Mapping[str, int],
    branches: Mapping[str, tuple[int, int]],
    blocks: tuple[int, int],
    batch: int = 1,
) -> float:
    """Estimated FLOPs of one native-pipeline request from its cache statistics.

    `branches`: per CFG branch name, (computed calls, cached calls); `text_tokens`: text tokens per branch name
    (a branch missing there gets the "cond" count); `blocks`: (blocks of a computed call, blocks of a cached call =
    Fn + Bn). Each branch runs its text path once (the native pipeline) and the fixed part on every call.
    """
    total = 0.0
    for name, (computed, cached) in branches.items():
        call = krea2_call_flops(config, image_tokens, text_tokens.get(name, text_tokens["cond"]), batch)
        blocks_run = computed * blocks[0] + cached * blocks[1]
        total += blocks_run * call.per_block + (computed + cached) * call.fixed + call.text
    return total
