"""Train the embedded Krea-2-architecture checkpoint (``dicache/assets/krea2-tiny``) on Twemoji.

Krea-2's own structure at toy size, saved in the diffusers layout that both our loader and diffusers'
``Krea2Pipeline`` load:

- VAE: ``AutoencoderKLQwenImage`` (×4: ``dim_mult`` of 3, ``temperal_downsample`` of 2, 16 latent channels),
  trained first (L1 + MSE + a light KL) on 128 px images; per-channel ``latents_mean``/``latents_std`` go into its
  config so the DiT sees unit-variance latents.
- Text encoder: a frozen, randomly initialised small ``Qwen3VLModel`` with a word-level tokenizer whose template
  prefix/suffix are 34/5 tokens like Qwen3-VL's (``build_tiny_tokenizer.py``).
- Transformer: ``Krea2Transformer2DModel`` trained with flow matching (``x_t = (1-σ)·x0 + σ·ε``, target ``ε - x0``,
  timestep = σ, logit-normal σ) and 10 % caption dropout to the empty prompt, so it serves both the no-CFG
  (Turbo-like, 8 steps) and the CFG (Raw-like, 28/50 steps, standard scale ≈ 4.5, i.e. diffusers
  ``guidance_scale = 3.5``) schedules.

Writes ``<out>/`` (the pipeline, ``training_log.json``, ``heldout_prompts.json``) and a sample grid.

Typical GPU command (H200, ≈ 7 min)::

    python scripts/train_embedded.py --data data/emoji64.npz --out dicache/assets/krea2-tiny \\
        --grid docs/krea2-tiny-grid.png --vae-seconds 105 --dit-seconds 290
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from build_tiny_tokenizer import (
    PREFIX_TOKENS,
    SUFFIX_TOKENS,
    TEMPLATE_PREFIX,
    build_tokenizer,
    portable_tokenizer_config,
)

# ----------------------------------------------------------------------------------------------------- configuration

IMAGE_SIZE = 128
TRAIN_TEXT_LEN = 32  # max_sequence_length while training; inference pads to 512, which must not change the result
TEXT_SELECT_LAYERS = (1, 2, 3, 4, 5, 6)  # hidden_states indices (0 = embeddings); the final, normed one is not tapped

VAE_CONFIG = {
    "base_dim": 32,
    "z_dim": 16,
    "dim_mult": [1, 2, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True],
}
TRANSFORMER_CONFIG = {
    "in_channels": 64,  # 16 latent channels × patch 2²
    "num_layers": 10,
    "attention_head_dim": 32,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 448,
    "timestep_embed_dim": 128,
    "text_hidden_dim": 128,
    "num_text_layers": len(TEXT_SELECT_LAYERS),
    "text_num_attention_heads": 4,
    "text_num_key_value_heads": 4,
    "text_intermediate_size": 256,
    "num_layerwise_text_blocks": 2,
    "num_refiner_text_blocks": 2,
    "axes_dims_rope": (8, 12, 12),
    "rope_theta": 1000.0,
}
TEXT_ENCODER_LAYERS = 7
TEXT_EMBED_STD = 0.06  # 3× the default init: keeps token identity visible in the deeper random layers
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 6400,
}

# Held out from training: skin-tone variants whose base emoji and tone are trained in other combinations, and colour
# variants of trained objects. Then a few training captions. One seed each; the sweep uses this file by default.
HELDOUT_PROMPTS = [
    "thumbs up sign medium skin tone",
    "waving hand sign dark skin tone",
    "father christmas medium dark skin tone",
    "ok hand sign light skin tone",
    "victory hand medium light skin tone",
    "clapping hands sign dark skin tone",
    "flexed biceps medium skin tone",
    "baby light skin tone",
    "person raising both hands in celebration medium dark skin tone",
    "raised fist medium light skin tone",
    "ear dark skin tone",
    "nail polish medium skin tone",
    "blue heart",
    "large green circle",
    "large purple square",
    "green book",
]
IN_DISTRIBUTION_PROMPTS = ["grinning face", "red apple", "rocket", "dog face", "slice of pizza", "japan flag"]

# --------------------------------------------------------------------------------------------------------- utilities


def log(msg: str) -> None:
    print(f"[train_embedded {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


class Budget:
    """Progress in [0, 1] of a phase limited by steps (if given, exact and reproducible) or else wall seconds."""

    def __init__(self, seconds: float, steps: int | None):
        self.seconds, self.steps, self.start, self.step = seconds, steps, time.time(), 0

    @property
    def elapsed(self) -> float:
        return time.time() - self.start

    @property
    def fraction(self) -> float:
        if self.steps is not None:
            return self.step / max(self.steps, 1)
        return self.elapsed / max(self.seconds, 1e-9)

    def done(self) -> bool:
        return self.fraction >= 1.0


def lr_at(budget: Budget, peak: float, warmup: int, decay_from: float = 0.7) -> float:
    """Linear warm-up, constant, then cosine decay to 10 % over the last ``1 - decay_from`` of the budget."""
    lr = peak * min(1.0, (budget.step + 1) / warmup)
    f = budget.fraction
    if f > decay_from:
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (f - decay_from) / (1 - decay_from))))
    return lr


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def mean_last(losses: list[torch.Tensor], k: int) -> float:
    return torch.stack(losses[-k:]).float().mean().item()


def loss_curve(values: list[float], points: int = 40) -> list[float]:
    if not values:
        return []
    chunks = np.array_split(np.asarray(values), min(points, len(values)))
    return [round(float(c.mean()), 5) for c in chunks]


# -------------------------------------------------------------------------------------------------------------- data


def load_data(path: str | Path) -> tuple[np.ndarray, list[str], str]:
    data = np.load(path)
    images = data["images"]
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"{path}: images must be uint8 (N, H, W, 3), got {images.dtype} {images.shape}")
    version = str(data["version"]) if "version" in data else "unknown"
    return images, [str(c) for c in data["captions"]], version


def to_pixels(images: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 (N, h, w, 3) → float (N, 3, 128, 128) in [-1, 1]; upsampled with bicubic interpolation."""
    x = torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float().div(127.5).sub(1)
    if x.shape[-1] != IMAGE_SIZE:
        x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bicubic", align_corners=False).clamp(-1, 1)
    return x.contiguous()


# ------------------------------------------------------------------------------------------------------- components


def make_text_encoder(tokenizer, seed: int):
    """A small random Qwen3-VL (tiny vision tower included, unused), bf16, frozen."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = tokenizer.convert_tokens_to_ids
    vocab = ((len(tokenizer) + 63) // 64) * 64
    cfg = Qwen3VLConfig(
        text_config={
            "vocab_size": vocab,
            "hidden_size": TRANSFORMER_CONFIG["text_hidden_dim"],
            "intermediate_size": 256,
            "num_hidden_layers": TEXT_ENCODER_LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": TRANSFORMER_CONFIG["text_hidden_dim"],
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    model = Qwen3VLModel(cfg)
    with torch.no_grad():
        model.language_model.embed_tokens.weight.normal_(0.0, TEXT_EMBED_STD)
    # Round to bf16 (the stored precision), then compute in fp32 like a default ``from_pretrained`` load does.
    return model.to(torch.bfloat16).float().eval().requires_grad_(False)


def make_pipeline(tokenizer, seed: int):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        Krea2Pipeline,
        Krea2Transformer2DModel,
    )

    text_encoder = make_text_encoder(tokenizer, seed)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(**VAE_CONFIG)
    torch.manual_seed(seed + 2)
    transformer = Krea2Transformer2DModel(**TRANSFORMER_CONFIG)
    return Krea2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        text_encoder_select_layers=TEXT_SELECT_LAYERS,
        is_distilled=False,
        patch_size=2,
    )


# ------------------------------------------------------------------------------------------------------------- text


@torch.no_grad()
def encode_texts(pipe, prompts: list[str], device: torch.device, max_len: int = TRAIN_TEXT_LEN, batch: int = 512):
    """The pipeline's own ``get_text_hidden_states`` over ``prompts`` → (float (P, L, taps, D), bool (P, L))."""
    too_long = [
        p for p in prompts if len(pipe.tokenizer(TEMPLATE_PREFIX + p)["input_ids"]) > PREFIX_TOKENS + max_len - 5
    ]
    if too_long:
        raise ValueError(f"{len(too_long)} prompts exceed {max_len - SUFFIX_TOKENS} tokens, e.g. {too_long[0]!r}")
    states, masks = [], []
    for i in range(0, len(prompts), batch):
        h, m = pipe.get_text_hidden_states(prompts[i : i + batch], max_sequence_length=max_len, device=device)
        states.append(h.float())
        masks.append(m)
    return torch.cat(states), torch.cat(masks)


def text_feature_stats(states: torch.Tensor, masks: torch.Tensor) -> dict:
    """Scale and distinctness of the frozen random encoder's taps (a degenerate encoder would give ~identical
    prompts): per tap, RMS over valid tokens and the mean |cosine| between centred mean-pooled prompts."""
    pooled = (states * masks[:, :, None, None]).sum(1) / masks.sum(1)[:, None, None]  # (P, taps, D)
    out = {"rms": [], "mean_abs_cos_between_prompts": []}
    for t in range(states.shape[2]):
        valid = states[:, :, t][masks]
        out["rms"].append(round(valid.pow(2).mean().sqrt().item(), 4))
        p = F.normalize(pooled[:, t] - pooled[:, t].mean(0), dim=-1)
        sim = (p @ p.T).abs()
        n = sim.shape[0]
        out["mean_abs_cos_between_prompts"].append(round(((sim.sum() - n) / max(n * (n - 1), 1)).item(), 4))
    return out


# -------------------------------------------------------------------------------------------------------------- VAE


@contextlib.contextmanager
def single_frame_convs():
    """Run ``QwenImageCausalConv3d`` on single frames as the equivalent 2D convolution: with the causal zero padding
    only the kernel's last temporal tap meets data, so this is exact for T = 1 (values and gradients) and ~3× cheaper.
    Used for training and encoding only; the saved weights are the ordinary 3D ones."""
    from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen_vae

    cls = qwen_vae.QwenImageCausalConv3d
    original = cls.forward

    def forward(self, x, cache_x=None):
        if x.shape[2] != 1 or cache_x is not None or self.stride[0] != 1 or self._padding[4] != self.kernel_size[0] - 1:
            return original(self, x, cache_x)
        x = F.pad(x[:, :, 0], self._padding[:4])
        y = F.conv2d(x, self.weight[:, :, -1], self.bias, self.stride[1:], 0, self.dilation[1:], self.groups)
        return y[:, :, None]

    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = original


def vae_losses(vae, x: torch.Tensor, kl_weight: float, generator: torch.Generator | None = None):
    post = vae.encode(x[:, :, None]).latent_dist
    z = post.sample(generator=generator)
    rec = vae.decode(z).sample[:, :, 0]
    l1 = (rec.float() - x).abs().mean()
    mse = (rec.float() - x).pow(2).mean()
    kl = 0.5 * (post.mean.float().pow(2) + post.var.float() - 1.0 - post.logvar.float()).mean()
    return l1 + mse + kl_weight * kl, {"l1": l1.detach(), "mse": mse.detach(), "kl": kl.detach()}


@torch.no_grad()
def check_single_frame_convs(vae, x: torch.Tensor) -> float:
    """Relative max difference of the encoder+decoder output with and without ``single_frame_convs``."""
    ref = vae.decode(vae.encode(x[:, :, None]).latent_dist.mean).sample
    with single_frame_convs():
        fast = vae.decode(vae.encode(x[:, :, None]).latent_dist.mean).sample
    return ((fast - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def train_vae(vae, pixels: torch.Tensor, args, device: torch.device) -> dict:
    vae.to(device)
    rel = check_single_frame_convs(vae, pixels[:2])
    if rel > 1e-2:
        raise RuntimeError(f"single-frame conv shortcut disagrees with the 3D convolutions (rel {rel:.2e})")
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0, betas=(0.9, 0.99))
    gen = torch.Generator(device=device).manual_seed(args.seed + 10)
    budget = Budget(args.vae_seconds, args.vae_steps)
    losses, last_print = [], 0.0
    while not budget.done():
        idx = torch.randint(0, pixels.shape[0], (args.vae_batch,), device=device, generator=gen)
        with autocast(device), single_frame_convs():
            loss, parts = vae_losses(vae, pixels[idx], args.kl_weight, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(budget, args.vae_lr, warmup=100)
        opt.step()
        losses.append(loss.detach())  # no .item(): keeps the GPU queue full
        budget.step += 1
        if budget.elapsed - last_print > 15:
            last_print = budget.elapsed
            parts_now = {k: round(v.item(), 4) for k, v in parts.items()}
            log(f"vae step {budget.step} {budget.elapsed:.0f}s loss {mean_last(losses, 20):.4f} {parts_now}")
    vae.eval()
    return {
        "steps": budget.step,
        "seconds": round(budget.elapsed, 1),
        "batch": args.vae_batch,
        "loss_first": round(losses[0].item(), 5),
        "loss_last": round(mean_last(losses, 20), 5),
        "loss_curve": loss_curve(torch.stack(losses).tolist()),
        "last_parts": {k: round(v.item(), 5) for k, v in parts.items()},
        "single_frame_conv_check_rel": rel,
    }


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Posterior means, (N, 16, 32, 32) float32."""
    with single_frame_convs():
        out = [
            vae.encode(pixels[i : i + batch, :, None].to(vae.dtype)).latent_dist.mean[:, :, 0].float()
            for i in range(0, len(pixels), batch)
        ]
    return torch.cat(out)


@torch.no_grad()
def reconstruction_psnr(vae, pixels: torch.Tensor) -> float:
    z = vae.encode(pixels[:, :, None].to(vae.dtype)).latent_dist.mean
    rec = vae.decode(z).sample[:, :, 0].float()
    mse = ((rec - pixels) / 2).pow(2).mean(dim=(1, 2, 3)).clamp_min(1e-10)
    return round((10 * torch.log10(1 / mse)).mean().item(), 2)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) → (B, H/2·W/2, C·4), the pipeline's patch-2 packing."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


# -------------------------------------------------------------------------------------------------------------- DiT


def train_dit(transformer, latents, states, masks, caption_idx, empty, args, device) -> dict:
    """Flow matching on packed normalised latents; ``caption_idx[i]`` indexes the text of image ``i``."""
    from diffusers import Krea2Pipeline

    transformer.to(device).train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.dit_lr, weight_decay=0.01, betas=(0.9, 0.99))
    ema = [p.detach().clone().float() for p in params]
    gen = torch.Generator(device=device).manual_seed(args.seed + 20)
    pos = Krea2Pipeline.prepare_position_ids(states.shape[1], 16, 16, device)
    empty_state, empty_mask = empty
    budget = Budget(args.dit_seconds, args.dit_steps)
    losses, last_print = [], 0.0
    n, bsz = latents.shape[0], args.dit_batch
    while not budget.done():
        idx = torch.randint(0, n, (bsz,), device=device, generator=gen)
        x0 = latents[idx]
        tidx = caption_idx[idx]
        text, mask = states[tidx], masks[tidx]
        drop = torch.rand(bsz, device=device, generator=gen) < args.caption_dropout
        text = torch.where(drop[:, None, None, None], empty_state, text)
        mask = torch.where(drop[:, None], empty_mask, mask)
        sigma = torch.sigmoid(torch.randn(bsz, device=device, generator=gen))
        noise = torch.randn(x0.shape, device=device, generator=gen)
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        with autocast(device):
            v = transformer(
                hidden_states=xt,
                encoder_hidden_states=text,
                timestep=sigma,
                position_ids=pos,
                encoder_attention_mask=mask,
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


# ------------------------------------------------------------------------------------------------- checks and grid


@torch.no_grad()
def padding_invariance(pipe, prompts: list[str], device: torch.device) -> dict:
    """The transformer's velocity with text padded to 32 vs 512 tokens (same prompts, latents, timestep)."""
    from diffusers import Krea2Pipeline

    g = torch.Generator("cpu").manual_seed(0)
    x = torch.randn(len(prompts), 256, TRANSFORMER_CONFIG["in_channels"], generator=g).to(
        device, pipe.transformer.dtype
    )
    t = torch.full((len(prompts),), 0.6, device=device, dtype=x.dtype)
    outs = []
    for length in (TRAIN_TEXT_LEN, 512):
        h, m = pipe.get_text_hidden_states(prompts, max_sequence_length=length, device=device)
        pos = Krea2Pipeline.prepare_position_ids(h.shape[1], 16, 16, device)
        h = h.to(x.dtype)
        outs.append(pipe.transformer(x, h, t, pos, encoder_attention_mask=m, return_dict=False)[0].float())
    diff = (outs[0] - outs[1]).abs().max().item()
    return {"max_abs_diff": diff, "rel": diff / outs[1].abs().max().item()}


@torch.no_grad()
def make_grid(pipe, entries: list[dict], out_path: Path, seeds: int, cfg_steps: int, turbo_steps: int, device) -> dict:
    """Rows = prompts; columns = ``seeds`` samples at ``cfg_steps`` with standard CFG 4.5 (diffusers guidance 3.5),
    then ``seeds`` samples at ``turbo_steps`` without CFG. A text label on the left."""
    from PIL import Image, ImageDraw

    prompts = [e["prompt"] for e in entries]
    columns, timings = [], {}
    for steps, guidance in ((cfg_steps, 3.5), (turbo_steps, 0.0)):
        t0 = time.time()
        for s in range(seeds):
            gens = [torch.Generator(device=device).manual_seed(e["seed"] + s) for e in entries]
            out = pipe(
                prompts,
                height=IMAGE_SIZE,
                width=IMAGE_SIZE,
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=gens,
                output_type="np",
            ).images
            columns.append(out)
        timings[f"{steps}_steps_guidance_{guidance}"] = round(time.time() - t0, 2)
    label_w, size = 300, IMAGE_SIZE
    grid = Image.new("RGB", (label_w + size * len(columns), size * len(prompts) + 20), "white")
    draw = ImageDraw.Draw(grid)
    draw.text((4, 4), "prompt (split)", fill="black")
    for c in range(len(columns)):
        head = f"{cfg_steps} st CFG 4.5" if c < seeds else f"{turbo_steps} st no CFG"
        draw.text((label_w + c * size + 4, 4), f"{head} s+{c % seeds}", fill="black")
    for r, e in enumerate(entries):
        y = 20 + r * size
        words, line, lines = e["prompt"].split(), "", []
        for w in words:
            if len(line) + len(w) + 1 > 44:
                lines.append(line)
                line = ""
            line = f"{line} {w}".strip()
        lines.append(f"{line} ({e['split']})")
        for i, text in enumerate(lines):
            draw.text((4, y + 4 + 12 * i), text, fill="black")
        for c, col in enumerate(columns):
            grid.paste(Image.fromarray((col[r] * 255).round().astype(np.uint8)), (label_w + c * size, y))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out_path)
    return {"path": str(out_path), "rows": len(prompts), "columns": len(columns), "seconds": timings}


# ------------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/emoji64.npz")
    ap.add_argument("--out", default="dicache/assets/krea2-tiny")
    ap.add_argument("--grid", default="docs/krea2-tiny-grid.png", help="sample grid path ('' to skip)")
    ap.add_argument("--device", default=env("DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vae-seconds", type=float, default=float(env("VAE_SECONDS", "105")))
    ap.add_argument("--dit-seconds", type=float, default=float(env("DIT_SECONDS", "290")))
    ap.add_argument("--vae-steps", type=int, default=None, help="fixed step count (overrides --vae-seconds)")
    ap.add_argument("--dit-steps", type=int, default=None, help="fixed step count (overrides --dit-seconds)")
    ap.add_argument("--vae-batch", type=int, default=64)
    ap.add_argument("--dit-batch", type=int, default=256)
    ap.add_argument("--vae-lr", type=float, default=5e-4)
    ap.add_argument("--dit-lr", type=float, default=4e-4)
    ap.add_argument("--kl-weight", type=float, default=1e-5)
    ap.add_argument("--caption-dropout", type=float, default=0.1)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--grid-seeds", type=int, default=3)
    ap.add_argument("--grid-cfg-steps", type=int, default=28)
    ap.add_argument("--grid-turbo-steps", type=int, default=8)
    ap.add_argument("--grid-max-prompts", type=int, default=0, help="0 = all")
    ap.add_argument("--max-images", type=int, default=0, help="train on an evenly spaced subset (0 = all)")
    return ap.parse_args(argv)


def heldout_entries() -> list[dict]:
    entries = [{"prompt": p, "seed": 1000 + i, "split": "heldout"} for i, p in enumerate(HELDOUT_PROMPTS)]
    n = len(entries)
    entries += [{"prompt": p, "seed": 1000 + n + i, "split": "train"} for i, p in enumerate(IN_DISTRIBUTION_PROMPTS)]
    return entries


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    timings = {}
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    images, captions, version = load_data(args.data)
    heldout = set(HELDOUT_PROMPTS)
    train_rows = [i for i, c in enumerate(captions) if c not in heldout]
    if args.max_images > 0:  # evenly spaced subset, for quick CPU runs
        train_rows = train_rows[:: math.ceil(len(train_rows) / args.max_images)][: args.max_images]
    found = sorted(heldout & set(captions))
    train_captions = [captions[i] for i in train_rows]
    train_words = {w for c in train_captions for w in c.split()}
    unseen = sorted({w for p in HELDOUT_PROMPTS + IN_DISTRIBUTION_PROMPTS for w in p.split()} - train_words)
    log(f"data {args.data}: {len(captions)} images, {len(train_rows)} for training, held out {len(found)}")
    if len(found) < len(HELDOUT_PROMPTS):
        log(f"WARNING: {len(HELDOUT_PROMPTS) - len(found)} held-out prompts are not in the data (fine for synthetic)")
    if unseen:
        log(f"WARNING: prompt words never seen in training captions: {unseen[:20]}")

    tokenizer = build_tokenizer(captions + IN_DISTRIBUTION_PROMPTS + HELDOUT_PROMPTS)
    pipe = make_pipeline(tokenizer, args.seed)
    pipe.text_encoder.to(device)
    sizes = {
        "transformer": param_count(pipe.transformer),
        "vae": param_count(pipe.vae),
        "vae_decoder": param_count(pipe.vae.decoder) + param_count(pipe.vae.post_quant_conv),
        "text_encoder": param_count(pipe.text_encoder),
        "text_encoder_language_model": param_count(pipe.text_encoder.language_model),
    }
    log(f"params: {sizes}")

    # text features, once: unique training captions + the empty prompt
    uniq = sorted(set(train_captions))
    cap_index = {c: i for i, c in enumerate(uniq)}
    states, masks = encode_texts(pipe, uniq, device)
    empty_state, empty_mask = encode_texts(pipe, [""], device)
    text_stats = text_feature_stats(states[:512], masks[:512])
    log(f"text taps: {text_stats}")
    caption_idx = torch.tensor([cap_index[c] for c in train_captions], device=device)

    pixels = to_pixels(images[train_rows], device)
    timings["prepare"] = round(time.time() - t_start, 1)
    vae_log = train_vae(pipe.vae, pixels, args, device)
    timings["vae"] = vae_log["seconds"]
    check_rows = np.linspace(0, len(train_rows) - 1, min(64, len(train_rows))).round().astype(int)
    vae_log["recon_psnr_fp32"] = reconstruction_psnr(pipe.vae, pixels[torch.from_numpy(check_rows).to(device)])
    z = encode_latents(pipe.vae, pixels)
    stats = [[round(v, 5) for v in t.tolist()] for t in (z.mean(dim=(0, 2, 3)), z.std(dim=(0, 2, 3)).clamp_min(1e-4))]
    pipe.vae.register_to_config(latents_mean=stats[0], latents_std=stats[1])
    mean, std = (torch.tensor(t, device=device) for t in stats)
    latents = pack((z - mean[None, :, None, None]) / std[None, :, None, None])
    del pixels, z
    log(f"vae: {vae_log['steps']} steps, loss {vae_log['loss_first']} -> {vae_log['loss_last']}")
    log(f"vae reconstruction PSNR {vae_log['recon_psnr_fp32']} dB; latent std range {min(stats[1])}..{max(stats[1])}")

    dit_log = train_dit(pipe.transformer, latents, states, masks, caption_idx, (empty_state, empty_mask), args, device)
    log(f"dit: {dit_log['steps']} steps, loss {dit_log['loss_first']} -> {dit_log['loss_last']}")

    timings["dit"] = dit_log["seconds"]

    t0 = time.time()
    save_pipeline(pipe, out_dir)
    entries = heldout_entries()
    note = (
        "split=heldout: captions removed from training (skin-tone/colour variants of trained emoji); split=train: "
        "training captions. Generate with the entry's seed (more samples: seed+1, seed+2, ...)."
    )
    payload = {"note": note, "image_size": IMAGE_SIZE, "prompts": entries}
    (out_dir / "heldout_prompts.json").write_text(json.dumps(payload, indent=2) + "\n")
    timings["save"] = round(time.time() - t0, 1)

    training_log = {
        "command": " ".join(["python", *sys.argv]) if argv is None else f"train_embedded.main({argv})",
        "args": vars(args),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__,
            "diffusers": __import__("diffusers").__version__,
            "transformers": __import__("transformers").__version__,
        },
        "data": {
            "path": str(args.data),
            "package": "emoji-datasource-twitter",
            "version": version,
            "images": len(captions),
            "train_images": len(train_rows),
            "heldout_found": found,
            "license": "Twemoji graphics CC-BY 4.0 (credit Twemoji)",
        },
        "params": sizes,
        "text_encoder_select_layers": list(TEXT_SELECT_LAYERS),
        "train_text_max_sequence_length": TRAIN_TEXT_LEN,
        "text_features": text_stats,
        "vae": vae_log,
        "dit": dit_log,
        "timings_s": timings,
    }
    log_path = out_dir / "training_log.json"
    log_path.write_text(json.dumps(training_log, indent=2) + "\n")  # written before anything that could fail

    # reload exactly as a user would, then check and sample; failures here are recorded, the checkpoint stays
    try:
        t0 = time.time()
        checks = verify_and_sample(out_dir, images[np.asarray(train_rows)[check_rows]], entries, args, device)
        vae_log["recon_psnr_stored_weights"] = checks.pop("recon_psnr_stored_weights")
        training_log.update(checks)
        timings["verify_and_grid"] = round(time.time() - t0, 1)
    except Exception as exc:  # noqa: BLE001 - keep the trained checkpoint and say what failed
        training_log["error"] = f"{type(exc).__name__}: {exc}"
        log(f"ERROR after saving: {training_log['error']}")
    files = {p.name: round(dir_size_mb(p) if p.is_dir() else p.stat().st_size / 1e6, 3) for p in out_dir.iterdir()}
    training_log["size_on_disk_mb"] = {"total": None, **dict(sorted(files.items()))}
    timings["total"] = round(time.time() - t_start, 1)
    log_path.write_text(json.dumps(training_log, indent=2) + "\n")
    training_log["size_on_disk_mb"]["total"] = round(dir_size_mb(out_dir), 3)
    log_path.write_text(json.dumps(training_log, indent=2) + "\n")
    log(f"saved {out_dir} ({training_log['size_on_disk_mb']['total']} MB) in {timings['total']} s")
    return training_log


def save_pipeline(pipe, out_dir: Path) -> None:
    """``save_pretrained`` with every weight in bf16, then make the configs load the same everywhere."""
    pipe.to("cpu")
    for name in ("transformer", "vae", "text_encoder"):  # all bf16 on disk, norms included (nn.Module.to: no warning)
        torch.nn.Module.to(getattr(pipe, name), torch.bfloat16)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    portable_tokenizer_config(out_dir / "tokenizer")
    # Weights stay bf16 on disk; config dtype float32 makes a plain ``from_pretrained`` load the text encoder in fp32
    # like diffusers loads the transformer and VAE (transformers would otherwise pick bf16 and the dtypes would clash).
    te_config = json.loads((out_dir / "text_encoder" / "config.json").read_text())
    te_config["dtype"] = te_config["torch_dtype"] = "float32"  # the second for transformers 4.x
    text = te_config["text_config"]  # transformers 4.x reads rope_theta/rope_scaling instead of rope_parameters
    text["rope_theta"] = text["rope_parameters"]["rope_theta"]
    text["rope_scaling"] = {k: v for k, v in text["rope_parameters"].items() if k != "rope_theta"}
    (out_dir / "text_encoder" / "config.json").write_text(json.dumps(te_config, indent=2) + "\n")
    index = json.loads((out_dir / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]  # transformers 5 would write TokenizersBackend
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    # dicache's own metadata: the native pipeline's default image size for this checkpoint
    meta = {
        "default_size": [IMAGE_SIZE, IMAGE_SIZE],
        "note": "dicache metadata; held-out prompts in heldout_prompts.json",
    }
    (out_dir / "dicache.json").write_text(json.dumps(meta, indent=2) + "\n")


def verify_and_sample(out_dir: Path, check_images: np.ndarray, entries: list[dict], args, device) -> dict:
    """Reload with a plain ``Krea2Pipeline.from_pretrained``; VAE PSNR with the stored weights, the padding check,
    and the sample grid."""
    from diffusers import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained(out_dir).to(device)
    dtypes = {n: str(getattr(pipe, n).dtype) for n in ("transformer", "vae", "text_encoder")}
    if set(dtypes.values()) != {"torch.float32"}:
        raise RuntimeError(f"a plain from_pretrained should load fp32 everywhere, got {dtypes}")
    pipe.set_progress_bar_config(disable=True)
    out = {"recon_psnr_stored_weights": reconstruction_psnr(pipe.vae, to_pixels(check_images, device))}
    out["padding_invariance_32_vs_512"] = padding_invariance(pipe, [e["prompt"] for e in entries[:4]] + [""], device)
    log(f"checks: {out}")
    if args.grid:
        chosen = entries[: args.grid_max_prompts] if args.grid_max_prompts > 0 else entries
        steps = (args.grid_cfg_steps, args.grid_turbo_steps)
        out["grid"] = make_grid(pipe, chosen, Path(args.grid), args.grid_seeds, *steps, device)
        log(f"grid: {out['grid']}")
    return out


if __name__ == "__main__":
    main()
