"""Ulysses sequence parallelism for Krea-2: image tokens sharded, text prefix replicated, attention over all tokens.

With degree `P`, process `r` of the sequence-parallel group computes the joint sequence `[text (T), image tokens
[r·n, (r+1)·n)]`, `n = N / P`: every per-token operation (norms, modulation, projections, SwiGLU, final layer) runs
on that share only. Around attention, one all-to-all trades the image shares of all heads for all image tokens of
`H / P` heads (the text prefix of those heads is already local); each head is attended over the full sequence by
the model's own kernel, and a second all-to-all trades back. The velocity of the image shares is all-gathered at the
end, so every process holds the full output (and runs the same scheduler step).

Exactness: per-token work on a row subset and per-head attention over the full sequence repeat the single-process
arithmetic, so the output is bitwise equal to one process wherever the matmul kernels give each row the same result
whatever the number of rows (true for CPU fp32, tested; on CUDA see benchmarks/RESULTS.md).

One forward at a time per process (collectives are ordered anyway): `SequenceShard` keeps the current forward's
token counts for the attention kernel and the cache's reduction layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .context import ParallelConfigError

# torch >= 2.13 renames all_gather_into_tensor (same signature); older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class SequenceShard:
    """The sequence split of one transformer on one process: group, degree, rank, and the current forward's counts.

    Installs as the transformer's `shard_image` / `gather_image` seams. Attributes set by `shard_image`:
    num_text_tokens (T, replicated on every process), num_image_tokens (N, all of them), local_image_tokens (n = N/P).
    """

    def __init__(self, group, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.num_text_tokens = 0
        self.num_image_tokens = 0
        self.local_image_tokens = 0

    def shard_image(
        self, hidden_states: torch.Tensor, positions: torch.Tensor, num_text_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, N, C)` image tokens and `(N, 3)` positions -> this process's contiguous share `(B, n, C)`, `(n, 3)`."""
        total = hidden_states.shape[1]
        if total % self.size:
            raise ParallelConfigError(
                f"{total} image tokens do not divide by --ulysses-degree {self.size}: choose a size whose token grid "
                f"(height/16 × width/16) is a multiple of {self.size}"
            )
        n = total // self.size
        self.num_text_tokens, self.num_image_tokens, self.local_image_tokens = num_text_tokens, total, n
        start = self.rank * n
        return hidden_states[:, start : start + n], positions[start : start + n]

    def gather_image(self, velocity: torch.Tensor) -> torch.Tensor:
        """This process's `(B, n, C)` share -> `(B, N, C)`, the same on every process of the group."""
        batch, n, channels = velocity.shape
        out = velocity.new_empty(self.size * batch, n, channels)
        _all_gather_single(out, velocity.contiguous(), group=self.group)
        return out.view(self.size, batch, n, channels).transpose(0, 1).reshape(batch, self.size * n, channels)


def _heads_to_peers(x: torch.Tensor, size: int) -> torch.Tensor:
    """`(B, H, n, D)` -> `(P, B, H/P, n, D)`: block `j` holds the heads peer `j` attends."""
    return x.unflatten(1, (size, -1)).transpose(0, 1)


class UlyssesAttention:
    """An `Attention.kernel` for a sequence-sharded joint sequence: `(q, k, v, key_mask) -> out`, all local.

    q: `(B, Hq, T + n, D)`, k, v: `(B, Hkv, T + n, D)` for this process's tokens; key_mask: `(B, T + n)` bool or None.
    Inside, `inner` (the module's own kernel) sees `(B, Hq/P, T + N, D)` / `(B, Hkv/P, T + N, D)`: heads
    `[r·H/P, (r+1)·H/P)` over every token. Returns `(B, Hq, T + n, D)`.
    """

    def __init__(self, shard: SequenceShard, inner: Callable[..., torch.Tensor]) -> None:
        self.shard, self.inner = shard, inner
        self._mask_in: torch.Tensor | None = None
        self._mask_out: torch.Tensor | None = None

    def _full_mask(self, key_mask: torch.Tensor | None) -> torch.Tensor | None:
        if key_mask is None:
            return None
        if key_mask is not self._mask_in:  # once per forward, not per block
            text = key_mask[:, : self.shard.num_text_tokens]
            image = key_mask.new_ones(key_mask.shape[0], self.shard.num_image_tokens)
            self._mask_in, self._mask_out = key_mask, torch.cat([text, image], dim=1)
        return self._mask_out

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        size, rank, text = self.shard.size, self.shard.rank, self.shard.num_text_tokens
        batch, q_heads, local_len, head_dim = query.shape
        kv_heads = key.shape[1]
        hq, hkv = q_heads // size, kv_heads // size
        n = local_len - text

        # image shares of every head -> every image token of this process's heads (one all-to-all for q, k, v)
        send = torch.cat(
            [_heads_to_peers(t[:, :, text:], size) for t in (query, key, value)], dim=2
        ).contiguous()  # (P, B, hq + 2·hkv, n, D)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.shard.group)
        image = received.permute(1, 2, 0, 3, 4).reshape(batch, hq + 2 * hkv, size * n, head_dim)
        q_img, k_img, v_img = image.split([hq, hkv, hkv], dim=1)
        q = torch.cat([query[:, rank * hq : (rank + 1) * hq, :text], q_img], dim=2)
        k = torch.cat([key[:, rank * hkv : (rank + 1) * hkv, :text], k_img], dim=2)
        v = torch.cat([value[:, rank * hkv : (rank + 1) * hkv, :text], v_img], dim=2)

        out = self.inner(q, k, v, self._full_mask(key_mask))  # (B, hq, T + N, D)

        # this process's heads of [text, peer j's image share] -> peer j; receive every head of [text, own share]
        text_out = out[:, :, :text].unsqueeze(0).expand(size, -1, -1, -1, -1)
        image_out = out[:, :, text:].unflatten(2, (size, n)).permute(2, 0, 1, 3, 4)
        send_back = torch.cat([text_out, image_out], dim=3).contiguous()  # (P, B, hq, T + n, D)
        received_back = torch.empty_like(send_back)
        dist.all_to_all_single(received_back, send_back, group=self.shard.group)
        return received_back.transpose(0, 1).reshape(batch, q_heads, local_len, head_dim)


def sequence_parallel_problems(model, size: int) -> list[str]:
    """Why `model`'s image attention cannot be split `size` (= tp × ulysses) ways by heads (empty: it can)."""
    problems = []
    for i, block in enumerate(model.transformer_blocks):
        attn = block.attn
        for what, count in (("query heads", attn.num_heads), ("key/value heads", attn.num_kv_heads)):
            if count % size:
                problems.append(f"transformer_blocks.{i}.attn: {count} {what} do not divide by tp × ulysses = {size}")
    return problems


def apply_sequence_parallel(model, rank: int, size: int, group) -> SequenceShard:
    """Install Ulysses on a `Krea2Transformer` (its sequence seams and every image block's attention kernel)."""
    shard = SequenceShard(group, size, rank)
    model.shard_image = shard.shard_image
    model.gather_image = shard.gather_image
    for block in model.transformer_blocks:
        block.attn.kernel = UlyssesAttention(shard, block.attn.kernel)
    return shard
