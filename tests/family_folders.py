"""Tiny diffusers pipelines of two registered families saved as checkpoint folders with text encoders and tokenizers,
so the commands run on them end to end: Flux.1 (true CFG, flow matching) and PixArt-Σ (batched CFG, DDIM, no sigmas).

The transformers, VAEs and schedulers are `tiny_families`' cases; the text side is the one `scripts/train_flux_tiny.py`
builds (a word-level tokenizer over the prompts, random frozen CLIP / T5 encoders from configs)."""

from __future__ import annotations

import sys
from pathlib import Path

import tiny_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train_flux_tiny as flux_script  # noqa: E402 (the scripts folder is not a package)

PROMPTS = ["red apple", "blue heart", "green book", "rocket", "dog face"]
CLIP = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
T5 = {"d_model": 32, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2}


def flux_folder(root: Path) -> Path:
    """Flux.1 at 16 px (×1 VAE, 64 image tokens), true CFG 2.0, 8 steps (its dicache.json)."""
    pipe, _ = tiny_families.flux()
    tokenizer = flux_script.build_tokenizer(PROMPTS, flux_script.CLIP_LEN)
    tokenizer_2 = flux_script.build_tokenizer(PROMPTS, flux_script.TEXT_LEN)
    clip, t5 = flux_script.build_text_encoders(len(tokenizer), {"clip": CLIP, "t5": T5}, seed=1)
    pipe.register_modules(text_encoder=clip, tokenizer=tokenizer, text_encoder_2=t5, tokenizer_2=tokenizer_2)
    extras = {"default_size": [16, 16], "sampling": {"steps": 8, "guidance": 2.0}, "call": {"max_sequence_length": 8}}
    folder = root / "flux-tiny-random"
    flux_script.save_pipeline(pipe, folder, {"dicache.json": extras})
    return folder


def pixart_folder(root: Path) -> Path:
    """PixArt-Σ at 16 px (×2 VAE), CFG 4.5 through `guidance_scale` (one batched call a step), 8 steps."""
    call = {"max_sequence_length": 8, "clean_caption": False, "use_resolution_binning": False}
    return _t5_folder(tiny_families.pixart()[0], root / "pixart-tiny-random", {"steps": 8, "guidance": 4.5}, call, 2)


def wan_folder(root: Path) -> Path:
    """Wan 2.1 (a video family) at 16 px, 9 frames, CFG 5.0 in two calls a step, 4 steps; a random frozen T5 encoder
    stands in for its UMT5 (the same call)."""
    call = {"max_sequence_length": 16, "num_frames": 9}
    return _t5_folder(tiny_families.wan()[0], root / "wan-tiny-random", {"steps": 4, "guidance": 5.0}, call, 3)


def _t5_folder(pipe, folder: Path, sampling: dict, call: dict, seed: int) -> Path:
    """`pipe` with a random frozen T5 encoder and a word-level tokenizer of `call["max_sequence_length"]` tokens,
    saved to `folder` with its dicache.json (16 px, `sampling`, `call`)."""
    tokenizer = flux_script.build_tokenizer(PROMPTS, call["max_sequence_length"])
    _, t5 = flux_script.build_text_encoders(len(tokenizer), {"clip": CLIP, "t5": T5}, seed=seed)
    pipe.register_modules(text_encoder=t5, tokenizer=tokenizer)
    extras = {"default_size": [16, 16], "sampling": sampling, "call": call}
    flux_script.save_pipeline(pipe, folder, {"dicache.json": extras})
    return folder
