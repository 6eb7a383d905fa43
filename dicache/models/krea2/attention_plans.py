"""One cuDNN attention plan for every prompt length (torch's `TORCH_CUDNN_SDPA_AVOID_RECOMPILE`).

torch's cuDNN attention builds a plan for each new shape, on each thread (38-40 ms on an H100, 50-75 ms on an H200),
paid by the first request of each prompt length (the joint sequence is the image's tokens plus the prompt's). With
`TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`, a call without an attention bias whose query, key, value and output are laid out
`(B, S, H, D)` in memory (the Krea-2 blocks' layout) runs cuDNN's padded kernel, whose plan is keyed by the sequence
lengths rounded up to a power of two: at 1024² (4096 image tokens) every prompt length, 4096 + n tokens with n up to
512, shares one plan, which the warm-up builds. torch reads the variable once, at the process's first cuDNN attention
call; `share()` sets it unless it is set already (`TORCH_CUDNN_SDPA_AVOID_RECOMPILE=0` keeps a plan per length).

Plain Python, no torch: `share` and `shared` on the environment, `plan_length` and `standing_for` on numbers.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, MutableMapping

ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE", "Y"})
"""The values torch reads as on (`c10::utils::check_env`); any other leaves a plan per shape."""


def share(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Ask torch for shared plans (`ENV=1`) unless `ENV` is set already; whether they are asked for. Effective only
    before the process's first cuDNN attention call (torch reads it then, once). Where this sets it, torch's notes
    about it are not shown: that it is experimental, and that a call with an attention bias or another layout (the
    text encoder's, the VAE's: one shape each) keeps its own plan."""
    if ENV not in environ:
        environ[ENV] = "1"
        warnings.filterwarnings("ignore", message=f"{ENV}=1", category=UserWarning)
    return shared(environ)


def shared(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether `ENV` asks for shared plans."""
    return environ.get(ENV, "").strip().upper() in TRUE_VALUES


def plan_length(sequence_length: int, shared_plans: bool) -> int:
    """The sequence length a cuDNN attention plan is keyed by: `sequence_length` itself, or with shared plans the
    power of two at or above it."""
    if sequence_length < 1:
        raise ValueError(f"sequence_length={sequence_length!r} must be >= 1")
    return 1 << (sequence_length - 1).bit_length() if shared_plans else sequence_length


def standing_for(text_lengths: Iterable[int], image_tokens: int, shared_plans: bool) -> dict[int, int]:
    """Each prompt length (real text tokens) -> the longest of `text_lengths` whose joint sequence (`image_tokens`
    more) has the same plan: meeting that one meets the plan of every length it stands for. Without shared plans
    each length stands for itself."""
    longest: dict[int, int] = {}
    lengths = sorted(set(text_lengths))
    for n in lengths:
        longest[plan_length(n + image_tokens, shared_plans)] = n
    return {n: longest[plan_length(n + image_tokens, shared_plans)] for n in lengths}
