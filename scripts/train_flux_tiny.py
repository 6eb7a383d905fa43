"""Train a small Flux.1-architecture checkpoint on Twemoji (issue 42): a second trained architecture for dicache.

Everything is a stock diffusers / transformers class, saved in the diffusers layout, so diffusers' own
``FluxPipeline.from_pretrained(dir)`` loads and runs it:

- VAE: ``AutoencoderKL`` (×4: three levels of (32, 64, 64) channels, 16 latent channels, as Flux's), trained first
  (L1 + MSE + a light KL) on the 64 px images; the posterior means' overall mean and std become its
  ``shift_factor`` / ``scaling_factor`` (what ``FluxPipeline`` undoes before decoding).
- Text: one word-level tokenizer over the captions (an end token appended, padded with ``<pad>``), saved twice as
  ``tokenizer`` (CLIP side, 16 tokens) and ``tokenizer_2`` (T5 side); a random, frozen ``CLIPTextModel`` (width 64,
  pooled output at the end token) and ``T5EncoderModel`` (width 128) built from configs.
- Transformer: ``FluxTransformer2DModel`` with double- and single-stream blocks (3 + 6, width 128 = 4 heads × 32,
  RoPE axes (8, 12, 12), no guidance embedding), trained with flow matching (``x_t = (1-σ)·x0 + σ·ε``, target
  ``ε - x0``, timestep σ, logit-normal σ) on the packed latents (64 image tokens) and the T5 sequence at
  ``max_sequence_length`` 32, with 10 % caption dropout to the empty prompt: sampled with true CFG
  (``true_cfg_scale`` 4.5, ``negative_prompt=""``) at 28 steps, the family's guidance for this model.

``dicache.json`` records what a user of the folder needs besides diffusers' defaults: the size (64 px), the
schedule (28 steps, true CFG 4.5) and ``max_sequence_length`` 32 (Flux does not mask padding: the text length the
model was trained on is part of the model). ``heldout_prompts.json`` holds the same 16 held-out captions as the
embedded Krea-2 checkpoint (removed from training) plus 6 training captions, one seed each.

One command on one GPU (≈ 7 min: VAE 80 s, DiT 300 s, the rest < 1 min) writes, under ``--out`` (default ``$OUT``,
else ``out/flux-tiny``), four files: ``flux-tiny.tar`` (the checkpoint folder ``flux-tiny/``), ``flux-tiny-grid.png``,
``train_flux_tiny_log.txt`` and ``training_log.json``::

    python scripts/train_flux_tiny.py --data data/emoji64.npz

CPU smoke run (tiny sizes, a few steps, about a minute; not a usable model)::

    python scripts/train_flux_tiny.py --smoke --data data/emoji64.npz --out /tmp/flux-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_embedded import (  # noqa: E402 (the scripts folder is not a package)
    Budget,
    dir_size_mb,
    heldout_entries,
    load_data,
    loss_curve,
    lr_at,
    mean_last,
    param_count,
)

NAME = "flux-tiny"
IMAGE_SIZE = 64
TEXT_LEN = 32  # T5 tokens (FluxPipeline's max_sequence_length): trained and sampled at this length
CLIP_LEN = 16  # CLIP tokens (the tokenizer's model_max_length)
STEPS, TRUE_CFG = 28, 4.5
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"

FULL = {
    "vae": {"block_out_channels": (32, 64, 64), "latent_channels": 16, "norm_num_groups": 32},
    "transformer": {"num_layers": 3, "num_single_layers": 6, "attention_head_dim": 32, "num_attention_heads": 4},
    "clip": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2},
    "t5": {"d_model": 128, "d_kv": 32, "d_ff": 256, "num_layers": 2, "num_heads": 4},
}
SMOKE = {
    "vae": {"block_out_channels": (8, 8, 8), "latent_channels": 4, "norm_num_groups": 4},
    "transformer": {"num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2},
    "clip": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2},
    "t5": {"d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2},
}
ROPE_AXES = {32: (8, 12, 12), 16: (4, 6, 6)}

LOG_LINES: list[str] = []


def log(msg: str) -> None:
    line = f"[train_flux_tiny {time.strftime('%H:%M:%S')}] {msg}"
    LOG_LINES.append(line)
    print(line, flush=True)


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


# ------------------------------------------------------------------------------------------------------- components


def build_tokenizer(captions: list[str], max_length: int):
    """A word-level ``PreTrainedTokenizerFast`` over the captions' words: ids ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2,
    then the words; every encoding ends with ``</s>`` (CLIP pools there; T5 ends with it too)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pattern = r"[a-z0-9]+|[^a-z0-9\s]"
    words = sorted({w for c in captions for w in __import__("re").findall(pattern, c.lower())})
    vocab = {PAD: 0, EOS: 1, UNK: 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="removed", invert=True)
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="right",
        model_max_length=max_length,
    )


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """Save in the portable ``PreTrainedTokenizerFast`` form (transformers 5 would otherwise name its own backend)."""
    tokenizer.save_pretrained(out_dir)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD,
        "eos_token": EOS,
        "unk_token": UNK,
        "padding_side": "right",
        "model_max_length": tokenizer.model_max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({k: config[k] for k in ("pad_token", "eos_token", "unk_token")}, indent=2) + "\n"
    )


def build_text_encoders(vocab_size: int, sizes: dict, seed: int):
    """A random CLIP text model (pooled at ``</s>``) and a random T5 encoder, frozen, float32."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    vocab = ((vocab_size + 63) // 64) * 64
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab,
            max_position_embeddings=CLIP_LEN,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
            projection_dim=sizes["clip"]["hidden_size"],
            **sizes["clip"],
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=vocab,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            use_cache=False,
            **sizes["t5"],
        )
    )
    for model in (clip, t5):
        model.requires_grad_(False).eval()
    return clip, t5


def build_vae(sizes: dict, seed: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    levels = len(sizes["vae"]["block_out_channels"])
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        layers_per_block=1,
        sample_size=IMAGE_SIZE,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0,
        scaling_factor=1.0,
        **sizes["vae"],
    )


def build_transformer(sizes: dict, latent_channels: int, joint_dim: int, pooled_dim: int, seed: int):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    t = sizes["transformer"]
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,
        joint_attention_dim=joint_dim,
        pooled_projection_dim=pooled_dim,
        guidance_embeds=False,
        axes_dims_rope=ROPE_AXES[t["attention_head_dim"]],
        **t,
    )


def build_pipeline(captions: list[str], sizes: dict, seed: int = 0):
    """The untrained ``FluxPipeline``: tokenizers over `captions`, random frozen text encoders, VAE, transformer, and
    Flux's flow-matching scheduler (dynamic shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    tokenizer = build_tokenizer(captions, CLIP_LEN)
    tokenizer_2 = build_tokenizer(captions, TEXT_LEN)
    clip, t5 = build_text_encoders(len(tokenizer), sizes, seed + 1)
    vae = build_vae(sizes, seed + 2)
    transformer = build_transformer(
        sizes, sizes["vae"]["latent_channels"], t5.config.d_model, clip.config.hidden_size, seed + 3
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def dicache_json(size: int = IMAGE_SIZE) -> dict:
    """What the folder's users need besides diffusers' defaults (read by `dicache.models.families`)."""
    return {
        "default_size": [size, size],
        "sampling": {"steps": STEPS, "guidance": TRUE_CFG},
        "call": {"max_sequence_length": TEXT_LEN},
        "note": "FluxPipeline at max_sequence_length 32 (trained so), true CFG 4.5 with negative_prompt '' (no "
        "guidance embedding); held-out prompts: heldout_prompts.json",
    }


BF16_COMPONENTS = ("transformer", "vae")
"""Stored in bf16; the small text encoders stay float32, because transformers loads a model in its stored dtype and
diffusers its own in float32: a plain `FluxPipeline.from_pretrained(dir)` then runs in float32 throughout."""


def save_pipeline(pipe, out_dir: Path, extras: dict) -> None:
    """``save_pretrained`` (transformer and VAE in bf16), the tokenizers portably, then the extra JSON files."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    for name in BF16_COMPONENTS:
        getattr(pipe, name).to(torch.bfloat16)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    for name in BF16_COMPONENTS:
        getattr(pipe, name).to(torch.float32)
    for name in ("tokenizer", "tokenizer_2"):
        if getattr(pipe, name, None) is not None:
            save_tokenizer(getattr(pipe, name), out_dir / name)
    for name, data in extras.items():
        (out_dir / name).write_text(json.dumps(data, indent=2) + "\n")


# -------------------------------------------------------------------------------------------------------------- data


def to_pixels(images: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 (N, 64, 64, 3) → float (N, 3, 64, 64) in [-1, 1]."""
    x = torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float().div(127.5).sub(1)
    if x.shape[-1] != IMAGE_SIZE:
        x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bicubic", align_corners=False).clamp(-1, 1)
    return x.contiguous()


@torch.no_grad()
def encode_texts(pipe, prompts: list[str], device: torch.device, batch: int = 512):
    """T5 sequences (N, TEXT_LEN, d) and CLIP pooled vectors (N, d') exactly as the pipeline encodes them."""
    seqs, pooled = [], []
    for i in range(0, len(prompts), batch):
        embeds, pool, _ = pipe.encode_prompt(
            prompts[i : i + batch], prompt_2=None, device=device, max_sequence_length=TEXT_LEN
        )
        seqs.append(embeds.float())
        pooled.append(pool.float())
    return torch.cat(seqs), torch.cat(pooled)


# -------------------------------------------------------------------------------------------------------------- VAE


def train_vae(vae, pixels: torch.Tensor, args, device: torch.device) -> dict:
    vae.to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0, betas=(0.9, 0.99))
    gen = torch.Generator(device=device).manual_seed(args.seed + 10)
    budget = Budget(args.vae_seconds, args.vae_steps)
    losses, last_print = [], 0.0
    while not budget.done():
        idx = torch.randint(0, pixels.shape[0], (args.vae_batch,), device=device, generator=gen)
        x = pixels[idx]
        with autocast(device):
            posterior = vae.encode(x).latent_dist
            z = posterior.sample(generator=gen)
            rec = vae.decode(z).sample.float()
        kl = posterior.kl().mean() / x[0].numel()
        loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + args.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(budget, args.vae_lr, warmup=100)
        opt.step()
        losses.append(loss.detach())
        budget.step += 1
        if budget.elapsed - last_print > 15:
            last_print = budget.elapsed
            log(f"vae step {budget.step} {budget.elapsed:.0f}s loss {mean_last(losses, 20):.4f}")
    vae.eval()
    return {
        "steps": budget.step,
        "seconds": round(budget.elapsed, 1),
        "batch": args.vae_batch,
        "loss_first": round(losses[0].item(), 5),
        "loss_last": round(mean_last(losses, 20), 5),
        "loss_curve": loss_curve(torch.stack(losses).tolist()),
    }


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Posterior means, (N, C, 16, 16) float32."""
    return torch.cat([vae.encode(pixels[i : i + batch]).latent_dist.mean.float() for i in range(0, len(pixels), batch)])


@torch.no_grad()
def reconstruction_psnr(vae, pixels: torch.Tensor) -> float:
    rec = vae.decode(vae.encode(pixels).latent_dist.mean).sample.float()
    mse = ((rec - pixels) / 2).pow(2).mean(dim=(1, 2, 3)).clamp_min(1e-10)
    return round((10 * torch.log10(1 / mse)).mean().item(), 2)


# -------------------------------------------------------------------------------------------------------------- DiT


def train_dit(pipe, latents, seqs, pooled, caption_idx, empty, args, device) -> dict:
    """Flow matching on packed normalised latents (FluxPipeline's packing and ids); ``caption_idx[i]`` indexes the
    text of image ``i``; ``empty`` is the encoded empty prompt (caption dropout, the CFG branch)."""
    transformer = pipe.transformer.to(device).train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.dit_lr, weight_decay=0.01, betas=(0.9, 0.99))
    ema = [p.detach().clone().float() for p in params]
    gen = torch.Generator(device=device).manual_seed(args.seed + 20)
    _, channels, height, width = latents.shape
    packed = pipe._pack_latents(latents, latents.shape[0], channels, height, width)
    img_ids = pipe._prepare_latent_image_ids(1, height // 2, width // 2, device, torch.float32)
    txt_ids = torch.zeros(TEXT_LEN, 3, device=device)
    empty_seq, empty_pooled = empty
    budget = Budget(args.dit_seconds, args.dit_steps)
    losses, last_print = [], 0.0
    n, bsz = packed.shape[0], args.dit_batch
    while not budget.done():
        idx = torch.randint(0, n, (bsz,), device=device, generator=gen)
        x0 = packed[idx]
        tidx = caption_idx[idx]
        drop = torch.rand(bsz, device=device, generator=gen) < args.caption_dropout
        text = torch.where(drop[:, None, None], empty_seq, seqs[tidx])
        pool = torch.where(drop[:, None], empty_pooled, pooled[tidx])
        sigma = torch.sigmoid(torch.randn(bsz, device=device, generator=gen))
        noise = torch.randn(x0.shape, device=device, generator=gen)
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        with autocast(device):
            v = transformer(
                hidden_states=xt,
                timestep=sigma,
                guidance=None,
                pooled_projections=pool,
                encoder_hidden_states=text,
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0]
        loss = F.mse_loss(v.float(), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(budget, args.dit_lr, warmup=300)
        opt.step()
        decay = min(args.ema, (1 + budget.step) / (10 + budget.step))
        torch._foreach_lerp_(ema, [p.detach().float() for p in params], 1 - decay)
        losses.append(loss.detach())
        budget.step += 1
        if budget.elapsed - last_print > 15:
            last_print = budget.elapsed
            log(f"dit step {budget.step} {budget.elapsed:.0f}s loss {mean_last(losses, 50):.4f}")
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    transformer.eval()
    return {
        "steps": budget.step,
        "seconds": round(budget.elapsed, 1),
        "batch": bsz,
        "loss_first": round(losses[0].item(), 5),
        "loss_last": round(mean_last(losses, 50), 5),
        "loss_curve": loss_curve(torch.stack(losses).tolist()),
        "ema": args.ema,
    }


# --------------------------------------------------------------------------------------------------- check and grid


@torch.no_grad()
def sample_grid(folder: Path, entries: list[dict], out_path: Path, seeds: int, steps: int, device) -> dict:
    """Reload the saved folder with diffusers' plain ``FluxPipeline.from_pretrained`` and draw a grid: a row per
    prompt, `seeds` columns at `steps` steps with true CFG (dicache.json's schedule)."""
    from diffusers import FluxPipeline
    from PIL import Image

    pipe = FluxPipeline.from_pretrained(folder).to(device)  # as a user would: no arguments
    pipe.set_progress_bar_config(disable=True)
    rows = []
    start = time.time()
    for entry in entries:
        row = []
        for k in range(seeds):
            out = pipe(
                entry["prompt"],
                negative_prompt="",
                true_cfg_scale=TRUE_CFG,
                num_inference_steps=steps,
                height=IMAGE_SIZE,
                width=IMAGE_SIZE,
                max_sequence_length=TEXT_LEN,
                generator=torch.Generator("cpu").manual_seed(entry["seed"] + k),
                output_type="np",
            )
            row.append(out.images[0])
        rows.append(np.concatenate(row, axis=1))
    grid = (np.concatenate(rows, axis=0) * 255).round().clip(0, 255).astype(np.uint8)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).save(out_path)
    return {
        "path": out_path.name,
        "prompts": [e["prompt"] for e in entries],
        "seeds": seeds,
        "steps": steps,
        "true_cfg_scale": TRUE_CFG,
        "seconds": round(time.time() - start, 1),
        "pixel_std": round(float(grid.std() / 255), 4),
    }


# -------------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/emoji64.npz", help="npz from scripts/prepare_emoji_data.py")
    ap.add_argument("--out", default=os.environ.get("OUT") or f"out/{NAME}", help="folder of the four outputs")
    ap.add_argument("--checkpoint", default=None, help="also leave the unpacked checkpoint folder here")
    ap.add_argument("--device", default=os.environ.get("DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vae-seconds", type=float, default=80.0)
    ap.add_argument("--dit-seconds", type=float, default=300.0)
    ap.add_argument("--vae-steps", type=int, default=None, help="exact step count (overrides --vae-seconds)")
    ap.add_argument("--dit-steps", type=int, default=None, help="exact step count (overrides --dit-seconds)")
    ap.add_argument("--vae-batch", type=int, default=64)
    ap.add_argument("--dit-batch", type=int, default=256)
    ap.add_argument("--vae-lr", type=float, default=5e-4)
    ap.add_argument("--dit-lr", type=float, default=4e-4)
    ap.add_argument("--kl-weight", type=float, default=1e-4)
    ap.add_argument("--caption-dropout", type=float, default=0.1)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--max-images", type=int, default=None, help="use the first N training images (smoke runs)")
    ap.add_argument("--grid-seeds", type=int, default=3)
    ap.add_argument("--grid-prompts", type=int, default=10, help="rows of the grid: held-out first, then training")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps on the CPU (a check, not a model)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device = "cpu"
        args.vae_steps = args.vae_steps or 3
        args.dit_steps = args.dit_steps or 3
        args.vae_batch = min(args.vae_batch, 4)
        args.dit_batch = min(args.dit_batch, 8)
        args.max_images = args.max_images or 32
        args.grid_seeds, args.grid_prompts = 1, 2
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    t_start, timings = time.time(), {}
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"device {device} ({torch.cuda.get_device_name(0) if device.type == 'cuda' else platform.processor()})")

    images, captions, version = load_data(args.data)
    entries = heldout_entries()
    heldout = {e["prompt"] for e in entries if e["split"] == "heldout"}
    rows = [i for i, c in enumerate(captions) if c not in heldout][: args.max_images]
    train_captions = [captions[i] for i in rows]
    unique = sorted(set(train_captions))
    caption_idx = torch.tensor([unique.index(c) for c in train_captions], device=device)
    log(f"{len(rows)} training images ({len(images) - len(rows)} held out or unused), {len(unique)} captions")

    pipe = build_pipeline(captions + [e["prompt"] for e in entries], sizes, args.seed)
    pipe.text_encoder.to(device)
    pipe.text_encoder_2.to(device)
    t = time.time()
    seqs, pooled = encode_texts(pipe, unique, device)
    empty = encode_texts(pipe, [""], device)
    timings["encode_text_s"] = round(time.time() - t, 1)
    pixels = to_pixels(images[rows], device)

    t = time.time()
    vae_log = train_vae(pipe.vae, pixels, args, device)
    timings["vae_s"] = round(time.time() - t, 1)
    latents = encode_latents(pipe.vae, pixels)
    shift, scale = latents.mean().item(), 1.0 / latents.std().item()
    pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    latents = (latents - shift) * scale
    vae_log.update(
        shift_factor=shift, scaling_factor=scale, reconstruction_psnr_db=reconstruction_psnr(pipe.vae, pixels[:256])
    )
    log(
        f"vae: {vae_log['steps']} steps, reconstruction {vae_log['reconstruction_psnr_db']} dB; "
        f"shift {shift:.4f} scale {scale:.4f}"
    )

    t = time.time()
    dit_log = train_dit(pipe, latents, seqs, pooled, caption_idx, empty, args, device)
    timings["dit_s"] = round(time.time() - t, 1)
    log(f"dit: {dit_log['steps']} steps, loss {dit_log['loss_first']} -> {dit_log['loss_last']}")

    record = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "diffusers": __import__("diffusers").__version__,
        "data": {"file": str(args.data), "version": version, "train_images": len(rows), "captions": len(unique)},
        "image_size": IMAGE_SIZE,
        "sizes": {k: {n: list(v) if isinstance(v, tuple) else v for n, v in d.items()} for k, d in sizes.items()},
        "params": {
            name: param_count(getattr(pipe, name)) for name in ("transformer", "vae", "text_encoder", "text_encoder_2")
        },
        "vae": vae_log,
        "dit": dit_log,
        "args": vars(args),
    }
    with tempfile.TemporaryDirectory() as work:
        folder = Path(args.checkpoint) if args.checkpoint else Path(work) / NAME
        heldout_file = {
            "note": "split=heldout: captions removed from training (skin-tone/colour variants of trained emoji); "
            "split=train: training captions. Generate with the entry's seed.",
            "image_size": IMAGE_SIZE,
            "prompts": entries,
        }
        save_pipeline(
            pipe,
            folder,
            {"dicache.json": dicache_json(), "heldout_prompts.json": heldout_file, "training_log.json": record},
        )
        record["checkpoint_mb"] = round(dir_size_mb(folder), 2)
        log(f"saved {folder} ({record['checkpoint_mb']} MB)")
        t = time.time()
        grid_entries = [e for e in entries if e["split"] == "heldout"][: args.grid_prompts // 2]
        grid_entries += [e for e in entries if e["split"] == "train"][: args.grid_prompts - len(grid_entries)]
        record["grid"] = sample_grid(folder, grid_entries, out / f"{NAME}-grid.png", args.grid_seeds, STEPS, device)
        timings["grid_s"] = round(time.time() - t, 1)
        timings["total_s"] = round(time.time() - t_start, 1)
        record["timings"] = timings
        (folder / "training_log.json").write_text(json.dumps(record, indent=2) + "\n")
        with tarfile.open(out / f"{NAME}.tar", "w") as tar:
            tar.add(folder, arcname=NAME)
    (out / "training_log.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"wrote {out / (NAME + '.tar')}, {out / (NAME + '-grid.png')} in {timings['total_s']} s")
    (out / "train_flux_tiny_log.txt").write_text("\n".join(LOG_LINES) + "\n")
    return record


if __name__ == "__main__":
    main()
