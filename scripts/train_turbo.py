"""Distil the embedded checkpoint into an 8-step, CFG-free Turbo student (``dicache/assets/krea2-tiny-turbo``).

Teacher: the embedded checkpoint (``krea2-tiny``) sampled exactly as the pipeline's ``raw`` preset does it — 50 Euler
steps on the resolution-aware sigmas, CFG with the standard scale s = 4.5 (``uncond + s·(cond − uncond)``, empty
negative prompt) — at 128 px, from Gaussian noise, on the training captions (the 16 held-out prompts never enter
training). Student: the same network initialised from the teacher, sampled as the ``turbo`` preset does it — 8 Euler
steps at the sigmas of mu = 1.15, one conditional call per step.

Method: trajectory (secant) matching at the student's sigmas, with on-policy correction.

1. Each teacher run is an Euler path, i.e. piecewise linear in sigma, so its state ``X(σ)`` is known exactly at every
   student sigma ``σ_0 = 1 > σ_1 > … > σ_8 = 0`` (``X(1)`` is the noise, ``X(0)`` the teacher's sample).
2. A student Euler step from ``X(σ_k)`` lands on ``X(σ_{k+1})`` iff its velocity is the secant
   ``(X(σ_{k+1}) − X(σ_k)) / (σ_{k+1} − σ_k)``; that is the regression target at input ``(X(σ_k), σ_k)``. If it were met
   everywhere, the student's 8 steps would reproduce the teacher's 50 CFG steps exactly. Unlike reflow on
   (noise, sample) pairs, every student step has its own target, so the student need not straighten the whole path.
3. A student never sits exactly on the teacher's path (its errors accumulate), so part of each batch uses the
   student's own states ``X̂_k`` (a no-grad rollout of the current weights from the same noise) with the target
   ``(X(σ_{k+1}) − X̂_k) / (σ_{k+1} − σ_k)``: the step that brings it back onto the teacher's path (DAgger-style).
   The last step's target is then exactly the teacher's sample.
Loss: MSE of the velocity, weighted per step by ``(Δσ_k / mean Δσ)^p`` (p = ``--step-weight-power``; 2 = the error
of the state a step lands on, 0 = plain velocity MSE). AdamW, bf16 autocast on CUDA, EMA; the raw or EMA weights,
whichever reproduces the teacher better on validation pairs (training captions, unseen noise), are saved in bf16.

Outputs in ``--out`` (only what differs from the base; the loader takes tokenizer, text encoder and VAE from the base
named in ``dicache.json``): ``model_index.json`` (``is_distilled: true``), ``transformer/``, ``scheduler/`` (mu pinned
at 1.15: base_shift = max_shift = 1.15), ``dicache.json``, ``training_log.json``. ``--grid``: rows = the 16 held-out
and 6 training prompts; columns = teacher 50 steps CFG 4.5 | student 8 | student 4 | base 8 steps without CFG.
``--work`` (optional) keeps the teacher pairs and a training checkpoint; ``--resume`` continues from them.

GPU command (H200, about 10 min in all; the shipped student: scripts/README_training.md)::

    python scripts/train_turbo.py --data data/emoji64.npz --out "$OUT/krea2-tiny-turbo" \\
        --grid "$OUT/krea2-tiny-turbo-grid.png" --work /tmp/turbo-work --teacher-seconds 80 --train-seconds 400

CPU smoke run (about a minute; not a usable model)::

    python scripts/train_turbo.py --smoke --out /tmp/turbo --grid /tmp/turbo.png --work /tmp/turbo-work
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python scripts/train_turbo.py` from anywhere
    sys.path.insert(0, str(REPO))

from dicache.models.krea2.pipeline import PRESETS, Krea2Pipeline, component_fingerprint  # noqa: E402
from dicache.models.krea2.scheduler import TURBO_MU  # noqa: E402
from dicache.models.krea2.text import KREA2_PROMPT_PREFIX  # noqa: E402
from dicache.models.krea2.transformer import Krea2Transformer, TextConditioning  # noqa: E402

IMAGE_SIZE = 128
TRAIN_TEXT_LEN = 32  # as the base was trained; padding to 512 gives the same velocity (checked by train_embedded)
STUDENT_STEPS = PRESETS["turbo"].num_inference_steps
TEACHER_SCALE = PRESETS["raw"].guidance_scale  # standard s = 4.5
TEACHER_STEPS = PRESETS["raw"].num_inference_steps  # 50
SHARED_COMPONENTS = ("tokenizer", "text_encoder", "vae")
DEFAULT_BASE = REPO / "dicache" / "assets" / "krea2-tiny"
BASE_POINTER = "../krea2-tiny"  # where the base sits relative to the shipped dicache/assets/krea2-tiny-turbo


def log(msg: str) -> None:
    print(f"[train_turbo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Budget:
    """Progress in [0, 1] of a phase limited by steps (exact, reproducible) or else wall seconds; resumable."""

    def __init__(self, seconds: float, steps: int | None, done_steps: int = 0, done_seconds: float = 0.0):
        self.seconds, self.steps, self.step = seconds, steps, done_steps
        self.start = time.time() - done_seconds

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


def lr_at(budget: Budget, peak: float, warmup: int, decay_from: float = 0.6) -> float:
    """Linear warm-up, constant, then cosine decay to 10 % over the last ``1 - decay_from`` of the budget."""
    lr = peak * min(1.0, (budget.step + 1) / warmup)
    f = budget.fraction
    if f > decay_from:
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (f - decay_from) / (1 - decay_from))))
    return lr


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def curve(values: list[float], points: int = 40) -> list[float]:
    if not values:
        return []
    return [round(float(c.mean()), 6) for c in np.array_split(np.asarray(values), min(points, len(values)))]


# ------------------------------------------------------------------------------------------------------ text, data


def training_captions(data: str, heldout: set[str], max_captions: int) -> list[str]:
    """Unique captions of the training images (held-out prompts removed), sorted; an evenly spaced subset if asked."""
    captions = sorted({str(c) for c in np.load(data)["captions"]} - heldout)
    if max_captions > 0:
        captions = captions[:: max(1, len(captions) // max_captions)][:max_captions]
    if not captions:
        raise ValueError(f"--data {data}: no training captions left after removing the held-out prompts")
    return captions


@torch.no_grad()
def encode_captions(pipe: Krea2Pipeline, captions: list[str], batch: int = 512):
    """Tapped text states `(P, L, taps, D)` fp32 and masks `(P, L)` at max_sequence_length 32 (training length)."""
    encoder = pipe.text_encoder
    previous, encoder.max_sequence_length = encoder.max_sequence_length, TRAIN_TEXT_LEN
    try:
        room = TRAIN_TEXT_LEN - encoder.suffix_len
        lengths = [len(encoder.tokenizer(KREA2_PROMPT_PREFIX + c).input_ids) - encoder.prefix_len for c in captions]
        too_long = [c for c, n in zip(captions, lengths) if n > room]
        if too_long:
            raise ValueError(f"{len(too_long)} captions exceed {room} tokens, e.g. {too_long[0]!r}")
        states, masks = [], []
        for i in range(0, len(captions), batch):
            h, m = encoder.encode(captions[i : i + batch])
            states.append(h.float())
            masks.append(m)
        return torch.cat(states), torch.cat(masks)
    finally:
        encoder.max_sequence_length = previous


# ----------------------------------------------------------------------------------------------------- sigma grids


def student_sigmas(pipe: Krea2Pipeline, steps: int = STUDENT_STEPS) -> torch.Tensor:
    """The turbo preset's sigmas (mu pinned at 1.15), `steps + 1` values ending at 0."""
    return pipe.scheduler.sigmas_for(steps, mu=TURBO_MU)


def teacher_sigmas(pipe: Krea2Pipeline, steps: int, tokens: int) -> torch.Tensor:
    """The raw preset's sigmas at `tokens` image tokens (resolution-aware mu), as the base pipeline uses them."""
    return pipe.sigmas(steps, tokens, "raw")


def path_states(
    step_sigmas: list[float], states: list[torch.Tensor], velocities: list[torch.Tensor], targets: list[float]
):
    """States of an Euler path at `targets` sigmas (each in [0, 1]): exact, as the path is linear within a step.

    step_sigmas: the N+1 sigmas of the run; states[i] the state at step_sigmas[i] (N+1 of them, the last the
    sample); velocities[i] the velocity used from step i (N). Target σ in (σ_{i+1}, σ_i] -> states[i] + (σ − σ_i)·v_i.
    """
    out = []
    for s in targets:
        if s <= step_sigmas[-1]:
            out.append(states[-1])
            continue
        i = max(j for j in range(len(step_sigmas) - 1) if step_sigmas[j] >= s)
        out.append(states[i] + (s - step_sigmas[i]) * velocities[i] if s != step_sigmas[i] else states[i])
    return out


# --------------------------------------------------------------------------------------------------------- teacher


class Teacher:
    """Batched CFG Euler sampling of the base transformer, recording the path at the student's sigmas."""

    def __init__(self, transformer: Krea2Transformer, pipe: Krea2Pipeline, empty, steps: int, scale: float):
        self.transformer, self.pipe = transformer, pipe
        self.empty_state, self.empty_mask = empty
        self.scale = scale
        self.positions = pipe.position_ids(*pipe.latent_grid(IMAGE_SIZE, IMAGE_SIZE), pipe.device)
        self.sigmas = teacher_sigmas(pipe, steps, self.positions.shape[0])
        self.model_t = pipe.scheduler.model_timesteps(self.sigmas).to(pipe.device)

    @torch.no_grad()
    def sample(self, noise: torch.Tensor, states: torch.Tensor, masks: torch.Tensor, targets: list[float]):
        """noise `(B, N, C)` fp32 -> the path at `targets` sigmas, `(B, len(targets), N, C)` fp32."""
        t = self.transformer
        b = noise.shape[0]
        cond = t.encode_text(states, masks)
        uncond = t.encode_text(self.empty_state.expand(b, -1, -1, -1), self.empty_mask.expand(b, -1))
        both = TextConditioning.concat([cond, uncond])
        sig = [float(s) for s in self.sigmas]
        x, xs, vs = noise, [noise], []
        for i in range(len(sig) - 1):
            out = t(torch.cat([x, x]), both, self.model_t[i].expand(2 * b), self.positions).float()
            vc, vu = out.chunk(2)
            v = vc + (self.scale - 1.0) * (vc - vu)
            x = self.pipe.scheduler.step(v, x, sig[i], sig[i + 1])
            xs.append(x)
            vs.append(v)
        return torch.stack(path_states(sig, xs, vs, targets), dim=1)


def generate_pairs(args, pipe, teacher, states, masks, device, targets, existing=None) -> dict:
    """Teacher paths for captions cycled in a seeded random order until the sample count or time budget is met."""
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    order = torch.randperm(len(states), generator=torch.Generator().manual_seed(args.seed))
    paths = [] if existing is None else [existing["paths"]]
    caps = [] if existing is None else [existing["caption_idx"]]
    done = 0 if existing is None else existing["paths"].shape[0]
    seconds0 = 0.0 if existing is None else existing["seconds"]
    budget = Budget(args.teacher_seconds, None, done_seconds=seconds0)
    tokens, channels = teacher.positions.shape[0], pipe.transformer.config.in_channels
    last = 0.0
    while done < args.teacher_samples and (done == 0 or not budget.done()):
        b = min(args.teacher_batch, args.teacher_samples - done)
        idx = order[(torch.arange(done, done + b)) % len(order)].to(device)
        noise = torch.randn((b, tokens, channels), generator=gen, device=device)
        path = teacher.sample(noise, states[idx], masks[idx], targets)  # in the teacher's own dtype
        paths.append(path)
        caps.append(idx)
        done += b
        if budget.elapsed - last > 10:
            last = budget.elapsed
            log(f"teacher: {done} paths in {budget.elapsed:.0f}s")
    return {"paths": torch.cat(paths), "caption_idx": torch.cat(caps), "seconds": round(budget.elapsed, 1)}


# --------------------------------------------------------------------------------------------------------- student


class Student:
    """The trainable copy: forward on raw text states (text fusion trains too), Euler rollouts at the student sigmas."""

    def __init__(self, transformer: Krea2Transformer, pipe: Krea2Pipeline, sigmas: torch.Tensor):
        self.transformer = transformer
        self.sigmas = [float(s) for s in sigmas]
        self.model_t = pipe.scheduler.model_timesteps(sigmas).to(pipe.device)
        self.positions = pipe.position_ids(*pipe.latent_grid(IMAGE_SIZE, IMAGE_SIZE), pipe.device)

    def velocity(self, x, states, masks, k: torch.Tensor) -> torch.Tensor:
        return self.transformer(x, states, self.model_t[k], self.positions, encoder_attention_mask=masks).float()

    @torch.no_grad()
    def rollout(self, noise, states, masks, steps: int | None = None) -> torch.Tensor:
        """States before each step, `(B, steps, N, C)`, and the result appended: `(B, steps + 1, N, C)` fp32."""
        steps = len(self.sigmas) - 1 if steps is None else steps
        cond = self.transformer.encode_text(states, masks)
        x, xs = noise, [noise]
        for k in range(steps):
            t = self.model_t[k].expand(x.shape[0])
            v = self.transformer(x, cond, t, self.positions).float()
            x = x + (self.sigmas[k + 1] - self.sigmas[k]) * v
            xs.append(x)
        return torch.stack(xs, dim=1)


def train(args, student: Student, pairs: dict, states, masks, device, resume_state: dict | None) -> dict:
    transformer = student.transformer
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    ema = [p.detach().clone().float() for p in params]
    hist = {"loss": [], "loss_teacher_states": [], "loss_own_states": [], "val": []}
    done_steps, done_seconds = 0, 0.0
    if resume_state is not None:
        transformer.load_state_dict(resume_state["student"])
        opt.load_state_dict(resume_state["optimizer"])
        for e, saved in zip(ema, resume_state["ema"]):
            e.copy_(saved)
        hist = resume_state["history"]
        done_steps, done_seconds = resume_state["step"], resume_state["seconds"]
        log(f"resumed at step {done_steps} ({done_seconds:.0f}s)")
    budget = Budget(args.train_seconds, args.train_steps, done_steps, done_seconds)
    gen = torch.Generator(device=device).manual_seed(args.seed + 2)
    if resume_state is not None and "generator" in resume_state:  # the batches an uninterrupted run would draw
        gen.set_state(resume_state["generator"].cpu())
    x_all, cap_all = pairs["paths"], pairs["caption_idx"]
    n_train = x_all.shape[0] - args.val_pairs
    sig = torch.tensor(student.sigmas, device=device)
    dsig = sig[1:] - sig[:-1]  # negative
    weights = (dsig.abs() / dsig.abs().mean()) ** args.step_weight_power
    steps = len(student.sigmas) - 1
    n_roll = max(1, round(args.onpolicy_fraction * args.batch / steps)) if args.onpolicy_fraction > 0 else 0
    last_print = last_ckpt = budget.elapsed
    while not budget.done():
        # teacher states: random (path, step) items
        on = n_roll if budget.fraction >= args.onpolicy_start else 0
        n_teacher = max(args.batch - on * steps, 0)
        i = torch.randint(0, n_train, (n_teacher,), device=device, generator=gen)
        k = torch.randint(0, steps, (n_teacher,), device=device, generator=gen)
        x_in, x_next = x_all[i, k], x_all[i, k + 1]
        cap, own = cap_all[i], torch.zeros(n_teacher, dtype=torch.bool, device=device)
        if on:  # the student's own states from the same noise, every step, target back onto the teacher's path
            j = torch.randint(0, n_train, (on,), device=device, generator=gen)
            transformer.eval()
            with autocast(device):
                roll = student.rollout(x_all[j, 0], states[cap_all[j]], masks[cap_all[j]], steps - 1)
            transformer.train()
            kk = torch.arange(steps, device=device).repeat(on)
            jj = j.repeat_interleave(steps)
            x_in = torch.cat([x_in, roll.reshape(-1, *roll.shape[2:])])
            x_next = torch.cat([x_next, x_all[jj, kk + 1]])
            k, cap = torch.cat([k, kk]), torch.cat([cap, cap_all[jj]])
            own = torch.cat([own, torch.ones(on * steps, dtype=torch.bool, device=device)])
        target = (x_next - x_in) / dsig[k][:, None, None]
        with autocast(device):
            v = student.velocity(x_in, states[cap], masks[cap], k)
        per_item = (v - target).pow(2).mean(dim=(1, 2)) * weights[k]
        loss = per_item.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(budget, args.lr, warmup=args.warmup)
        opt.step()
        decay = min(args.ema, (1 + budget.step) / (10 + budget.step))
        torch._foreach_lerp_(ema, [p.detach().float() for p in params], 1 - decay)
        budget.step += 1
        with torch.no_grad():
            hist["loss"].append(loss.detach())
            if (~own).any():
                hist["loss_teacher_states"].append(per_item[~own].mean().detach())
            if own.any():
                hist["loss_own_states"].append(per_item[own].mean().detach())
        if budget.elapsed - last_print > args.val_seconds or budget.done():
            last_print = budget.elapsed
            recent = torch.stack(hist["loss"][-50:]).mean().item()
            val = validation_psnr(student, pairs, states, masks, args.val_pairs, device)
            hist["val"].append({"step": budget.step, "seconds": round(budget.elapsed, 1), "latent_psnr": val})
            log(f"train step {budget.step} {budget.elapsed:.0f}s loss {recent:.5f} val latent PSNR {val:.2f} dB")
        if args.work and budget.elapsed - last_ckpt > args.checkpoint_seconds:
            last_ckpt = budget.elapsed
            save_training_state(args, transformer, opt, ema, hist, budget, gen)
    if args.work:
        save_training_state(args, transformer, opt, ema, hist, budget, gen)
    transformer.eval()
    # raw vs EMA weights: keep the one closer to the teacher on the validation pairs
    val_raw = validation_psnr(student, pairs, states, masks, args.val_pairs, device)
    raw = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    val_ema = validation_psnr(student, pairs, states, masks, args.val_pairs, device)
    chosen = "ema" if val_ema >= val_raw else "raw"
    if chosen == "raw":
        with torch.no_grad():
            for p, r in zip(params, raw):
                p.copy_(r)
    log(f"validation latent PSNR: raw {val_raw:.2f} dB, EMA {val_ema:.2f} dB -> saving {chosen}")

    def floats(key):
        return [float(v) for v in torch.stack(hist[key]).tolist()] if hist[key] else []

    return {
        "steps": budget.step,
        "seconds": round(budget.elapsed, 1),
        "batch": args.batch,
        "onpolicy_paths_per_batch": n_roll,
        "loss_first": round(floats("loss")[0], 6),
        "loss_last": round(float(np.mean(floats("loss")[-50:])), 6),
        "loss_curve": curve(floats("loss")),
        "loss_teacher_states_curve": curve(floats("loss_teacher_states")),
        "loss_own_states_curve": curve(floats("loss_own_states")),
        "validation": hist["val"],
        "validation_final": {"raw": round(val_raw, 3), "ema": round(val_ema, 3), "saved": chosen},
        "step_weights": [round(w, 4) for w in weights.tolist()],
    }


@torch.no_grad()
def validation_psnr(student: Student, pairs: dict, states, masks, count: int, device, batch: int = 256) -> float:
    """Mean latent PSNR (peak = the teacher samples' range) of the student's 8 steps vs the teacher's sample, on the
    last `count` pairs (held out from training: training captions, unseen noise)."""
    x_all, caps = pairs["paths"][-count:], pairs["caption_idx"][-count:]
    t = student.transformer
    was_training = t.training
    t.eval()
    out = []
    for i in range(0, count, batch):
        with autocast(device):
            roll = student.rollout(x_all[i : i + batch, 0], states[caps[i : i + batch]], masks[caps[i : i + batch]])
        ref = x_all[i : i + batch, -1]
        peak = (ref.amax(dim=(1, 2)) - ref.amin(dim=(1, 2))).clamp_min(1e-6)
        mse = (roll[:, -1] - ref).pow(2).mean(dim=(1, 2)).clamp_min(1e-12)
        out.append(10 * torch.log10(peak**2 / mse))
    t.train(was_training)
    return round(torch.cat(out).mean().item(), 3)


def save_training_state(args, transformer, opt, ema, hist, budget, gen) -> None:
    work = Path(args.work)
    tmp = work / "train_state.pt.tmp"
    torch.save(
        {
            "student": transformer.state_dict(),
            "optimizer": opt.state_dict(),
            "ema": ema,
            "history": hist,
            "step": budget.step,
            "seconds": budget.elapsed,
            "generator": gen.get_state(),
        },
        tmp,
    )
    tmp.replace(work / "train_state.pt")


# ------------------------------------------------------------------------------------------------------ save, eval


def save_student(transformer: Krea2Transformer, base: Path, out: Path, base_pointer: str) -> None:
    """Only what differs from the base, in the diffusers layout; weights in bf16 (norm weights too, as the base)."""
    from safetensors.torch import save_file

    (out / "transformer").mkdir(parents=True, exist_ok=True)
    (out / "scheduler").mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in transformer.state_dict().items()}
    save_file(tensors, out / "transformer" / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(base / "transformer" / "config.json", out / "transformer" / "config.json")
    scheduler = json.loads((base / "scheduler" / "scheduler_config.json").read_text())
    scheduler["base_shift"] = scheduler["max_shift"] = TURBO_MU  # mu = 1.15 at every resolution, diffusers included
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2) + "\n")
    index = json.loads((base / "model_index.json").read_text())
    index["is_distilled"] = True
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    base_meta = json.loads((base / "dicache.json").read_text()) if (base / "dicache.json").is_file() else {}
    meta = {
        "default_size": base_meta.get("default_size", [IMAGE_SIZE, IMAGE_SIZE]),
        "base_checkpoint": base_pointer,
        "shared_components": list(SHARED_COMPONENTS),
        "base_files_sha256": {name: component_fingerprint(base / name) for name in ("text_encoder", "vae")},
        "note": (
            "dicache metadata: a Turbo student distilled from the base checkpoint; tokenizer, text encoder and VAE "
            "are the base's (base_checkpoint, relative to this folder), held-out prompts in the base's "
            "heldout_prompts.json; training log in training_log.json"
        ),
    }
    (out / "dicache.json").write_text(json.dumps(meta, indent=2) + "\n")


def heldout_entries(base: Path) -> list[dict]:
    return json.loads((base / "heldout_prompts.json").read_text())["prompts"]


def initial_noise(pipe: Krea2Pipeline, seeds: list[int]) -> torch.Tensor:
    """The pipeline's own noise for each seed (a CPU generator per sample, as `pipe(..., seed=s)` draws it)."""
    return torch.cat(
        [pipe.initial_latents(1, IMAGE_SIZE, IMAGE_SIZE, torch.Generator("cpu").manual_seed(int(s))) for s in seeds]
    )


@torch.no_grad()
def run_pipe(pipe: Krea2Pipeline, prompts, noise, variant: str, steps: int | None = None, scale: float | None = None):
    """Decoded images `(B, 3, H, W)` in [0, 1] through the pipeline's own `__call__` (fixed initial latents)."""
    out = pipe(
        prompts,
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        latents=noise,
        variant=variant,
        num_inference_steps=steps,
        guidance_scale=scale,
        output_type="pt",
    )
    return out.images.float().cpu()


@torch.no_grad()
def evaluate(
    base_pipe: Krea2Pipeline,
    student_pipe: Krea2Pipeline,
    entries: list[dict],
    eval_steps: list[int],
    teacher_steps: int = TEACHER_STEPS,
):
    """PSNR vs the teacher (base, `teacher_steps` = 50, CFG 4.5) per prompt for the student at each step count and
    for the base's 8-step no-CFG run (what the 'turbo' variant was before); returns (table, images by column)."""
    from dicache.sweep.metrics import psnr

    prompts, seeds = [e["prompt"] for e in entries], [e["seed"] for e in entries]
    noise = initial_noise(base_pipe, seeds)
    images = {"teacher 50 st CFG 4.5": run_pipe(base_pipe, prompts, noise, "raw", steps=teacher_steps)}
    for n in eval_steps:
        images[f"student {n} st"] = run_pipe(student_pipe, prompts, noise, "turbo", steps=n)
    images["base 8 st no CFG"] = run_pipe(base_pipe, prompts, noise, "turbo", steps=STUDENT_STEPS, scale=1.0)
    ref = images["teacher 50 st CFG 4.5"]
    table = {}
    for name, imgs in images.items():
        if name.startswith("teacher"):
            continue
        values = psnr(imgs, ref)
        by_split: dict[str, list[float]] = {}
        for e, v in zip(entries, values):
            by_split.setdefault(e.get("split", "heldout"), []).append(v)
        table[name] = {
            **{f"mean_{s}": round(float(np.mean(v)), 3) for s, v in by_split.items()},
            **{f"min_{s}": round(float(np.min(v)), 3) for s, v in by_split.items()},
            "per_prompt": [round(v, 3) for v in values],
        }
    return table, images


def write_grid(entries: list[dict], images: dict, columns: list[str], path: Path) -> dict:
    from PIL import Image, ImageDraw

    size, label_w = IMAGE_SIZE, 300
    grid = Image.new("RGB", (label_w + size * len(columns), size * len(entries) + 20), "white")
    draw = ImageDraw.Draw(grid)
    draw.text((4, 4), "prompt (split), seed", fill="black")
    for c, name in enumerate(columns):
        draw.text((label_w + c * size + 4, 4), name, fill="black")
    for r, e in enumerate(entries):
        y = 20 + r * size
        words, line, lines = e["prompt"].split(), "", []
        for w in words:
            if len(line) + len(w) + 1 > 44:
                lines.append(line)
                line = ""
            line = f"{line} {w}".strip()
        lines.append(f"{line} ({e.get('split', '?')}), {e['seed']}")
        for i, text in enumerate(lines):
            draw.text((4, y + 4 + 12 * i), text, fill="black")
        for c, name in enumerate(columns):
            arr = (images[name][r].permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype(np.uint8)
            grid.paste(Image.fromarray(arr), (label_w + c * size, y))
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return {"path": str(path), "rows": len(entries), "columns": columns}


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/emoji64.npz", help="captions of the training images (npz)")
    ap.add_argument("--base", default=str(DEFAULT_BASE), help="teacher checkpoint folder (the embedded krea2-tiny)")
    ap.add_argument("--out", default=str(REPO / "dicache" / "assets" / "krea2-tiny-turbo"))
    ap.add_argument(
        "--init",
        default="",
        help="start the student from this checkpoint folder (a previous stage's --out) instead of the base",
    )
    ap.add_argument("--base-pointer", default=BASE_POINTER, help="dicache.json base_checkpoint, relative to --out")
    ap.add_argument("--grid", default="docs/krea2-tiny-turbo-grid.png", help="sample grid path ('' to skip)")
    ap.add_argument("--work", default="", help="folder for teacher pairs and training checkpoints ('' = none)")
    ap.add_argument("--resume", action="store_true", help="continue from --work (teacher pairs, training state)")
    ap.add_argument("--device", default=env("DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--teacher-seconds", type=float, default=float(env("TEACHER_SECONDS", "70")))
    ap.add_argument("--teacher-samples", type=int, default=16384, help="most teacher paths (also stops at seconds)")
    ap.add_argument("--teacher-batch", type=int, default=1024)
    ap.add_argument("--teacher-steps", type=int, default=TEACHER_STEPS)
    ap.add_argument("--teacher-dtype", choices=("bfloat16", "float32"), default=None, help="default: bf16 on CUDA")
    ap.add_argument("--train-seconds", type=float, default=float(env("TRAIN_SECONDS", "170")))
    ap.add_argument("--train-steps", type=int, default=None, help="fixed step count (overrides --train-seconds)")
    ap.add_argument("--batch", type=int, default=512, help="(state, step) items per training step")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--ema", type=float, default=0.995)
    ap.add_argument("--onpolicy-fraction", type=float, default=0.5, help="share of a batch on the student's states")
    ap.add_argument("--onpolicy-start", type=float, default=0.15, help="budget fraction before on-policy items")
    ap.add_argument("--step-weight-power", type=float, default=1.0)
    ap.add_argument("--val-pairs", type=int, default=256, help="teacher pairs kept out of training for validation")
    ap.add_argument("--checkpoint-seconds", type=float, default=60.0)
    ap.add_argument("--val-seconds", type=float, default=15.0, help="log and validate at most this often")
    ap.add_argument("--max-captions", type=int, default=0, help="use an evenly spaced subset (0 = all)")
    ap.add_argument("--eval-steps", type=int, nargs="+", default=[8, 4, 5, 6], help="student step counts evaluated")
    ap.add_argument("--eval-teacher-steps", type=int, default=TEACHER_STEPS, help="the reference's steps (raw: 50)")
    ap.add_argument("--eval-max-prompts", type=int, default=0, help="0 = all of heldout_prompts.json")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: a few paths and steps, 2 prompts")
    ap.add_argument(
        "--teacher-only",
        action="store_true",
        help="stop after saving the teacher paths in --work (students trained in parallel share them via --resume)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.device = "cpu"
        args.teacher_samples, args.teacher_batch, args.teacher_steps = 12, 6, 6
        args.train_steps, args.batch, args.val_pairs, args.max_captions = 3, 16, 4, 24
        args.onpolicy_start, args.eval_max_prompts, args.eval_steps = 0.0, 2, [8, 4]
        args.checkpoint_seconds, args.eval_teacher_steps = 0.0, 6
    if args.teacher_dtype is None:
        args.teacher_dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    if args.val_pairs < 1 or args.val_pairs >= args.teacher_samples:
        ap.error(f"--val-pairs={args.val_pairs} is invalid: must be in [1, --teacher-samples)")
    if not 0 <= args.onpolicy_fraction <= 1:
        ap.error(f"--onpolicy-fraction={args.onpolicy_fraction} is invalid: must be in [0, 1]")
    if args.teacher_only and not args.work:
        ap.error("--teacher-only needs --work (the folder the teacher paths are saved in)")
    if args.resume and not args.work:
        ap.error("--resume needs --work (the folder holding the teacher pairs and the training state)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    timings: dict[str, float] = {}
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":  # training in bf16 autocast; evaluation below switches TF32 off
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    base, out = Path(args.base), Path(args.out)
    work = Path(args.work) if args.work else None
    if work:
        work.mkdir(parents=True, exist_ok=True)

    base_pipe = Krea2Pipeline.from_pretrained(base, dtype=torch.float32, device=device)
    base_pipe.set_progress_bar_config(disable=True)
    entries = heldout_entries(base)
    heldout = {e["prompt"] for e in entries if e.get("split") == "heldout"}
    captions = training_captions(args.data, heldout, args.max_captions)
    states, masks = encode_captions(base_pipe, captions)
    empty = encode_captions(base_pipe, [""])
    log(f"{len(captions)} training captions encoded; device {device}")

    targets = [float(s) for s in student_sigmas(base_pipe)]
    pairs_file = work / "teacher_pairs.pt" if work else None
    pairs = None
    if args.resume and pairs_file and pairs_file.is_file():
        pairs = torch.load(pairs_file, map_location=device)
        log(f"resumed {pairs['paths'].shape[0]} teacher paths from {pairs_file}")
    if pairs is None or pairs["paths"].shape[0] < args.teacher_samples and pairs["seconds"] < args.teacher_seconds:
        teacher_model = Krea2Transformer.from_pretrained(
            base, dtype=getattr(torch, args.teacher_dtype), device=device
        ).requires_grad_(False)
        teacher = Teacher(teacher_model, base_pipe, empty, args.teacher_steps, TEACHER_SCALE)
        pairs = generate_pairs(args, base_pipe, teacher, states, masks, device, targets, existing=pairs)
        del teacher_model, teacher
        if pairs_file:
            torch.save(pairs, pairs_file)
    n_pairs = pairs["paths"].shape[0]
    if n_pairs <= args.val_pairs:
        raise RuntimeError(
            f"only {n_pairs} teacher paths: need more than --val-pairs={args.val_pairs}; rerun with a smaller "
            "--val-pairs (with --work and --resume the saved teacher paths are reused) or a larger --teacher-seconds"
        )
    timings["teacher"] = pairs["seconds"]
    log(f"teacher: {n_pairs} paths of {len(targets)} states ({pairs['seconds']}s)")
    if args.teacher_only:
        return {"teacher": {"paths": n_pairs, "seconds": pairs["seconds"], "file": str(pairs_file)}}

    init = Path(args.init) if args.init else base
    student_model = Krea2Transformer.from_pretrained(init, dtype=torch.float32, device=device)
    student_model.requires_grad_(True)
    student = Student(student_model, base_pipe, torch.tensor(targets))
    val_before = validation_psnr(student, pairs, states, masks, args.val_pairs, device)
    log(f"validation latent PSNR before training ({init.name}, 8 steps, no CFG): {val_before:.2f} dB")
    resume_state = None
    state_file = work / "train_state.pt" if work else None
    if args.resume and state_file and state_file.is_file():
        resume_state = torch.load(state_file, map_location=device)
    train_log = train(args, student, pairs, states, masks, device, resume_state)
    train_log["validation_before"] = val_before
    timings["train"] = train_log["seconds"]

    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    save_student(student_model, base, out, args.base_pointer)
    timings["save"] = round(time.time() - t0, 1)
    training_log = {
        "command": " ".join(["python", *sys.argv]) if argv is None else f"train_turbo.main({argv})",
        "args": vars(args),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__},
        "method": "secant trajectory matching at the student's sigmas + on-policy correction (see the script)",
        "teacher": {
            "checkpoint": str(base),
            "steps": args.teacher_steps,
            "guidance_scale_standard": TEACHER_SCALE,
            "sigmas": [round(float(s), 6) for s in teacher_sigmas(base_pipe, args.teacher_steps, 256)],
            "dtype": args.teacher_dtype,
            "paths": n_pairs,
            "captions": len(captions),
            "seconds": pairs["seconds"],
        },
        "student": {"steps": STUDENT_STEPS, "sigmas": [round(s, 6) for s in targets], "mu": TURBO_MU},
        "train": train_log,
        "init": str(init),
        "previous_stage": json.loads((init / "training_log.json").read_text()) if args.init else None,
        "timings_s": timings,
    }
    log_path = out / "training_log.json"
    log_path.write_text(json.dumps(training_log, indent=2) + "\n")  # before anything that could fail

    # reload as a user would (shared components from the base), evaluate in fp32 without TF32, draw the grid
    try:
        t0 = time.time()
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        student_pipe = Krea2Pipeline.from_pretrained(out, dtype=torch.float32, device=device, base=base)
        student_pipe.set_progress_bar_config(disable=True)
        chosen = entries[: args.eval_max_prompts] if args.eval_max_prompts > 0 else entries
        table, images = evaluate(base_pipe, student_pipe, chosen, args.eval_steps, args.eval_teacher_steps)
        training_log["eval_vs_teacher_psnr_db"] = table
        for name, row in table.items():
            summary = ", ".join(f"{k} {v}" for k, v in row.items() if k != "per_prompt")
            log(f"PSNR vs teacher 50 st CFG 4.5, {name}: {summary}")
        if args.grid:
            columns = ["teacher 50 st CFG 4.5", "student 8 st", "student 4 st", "base 8 st no CFG"]
            columns = [c for c in columns if c in images]
            training_log["grid"] = write_grid(chosen, images, columns, Path(args.grid))
        timings["eval_and_grid"] = round(time.time() - t0, 1)
    except Exception as exc:  # noqa: BLE001 - keep the trained student and say what failed
        training_log["error"] = f"{type(exc).__name__}: {exc}"
        log(f"ERROR after saving: {training_log['error']}")
    training_log["size_on_disk_mb"] = round(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6, 3)
    timings["total"] = round(time.time() - t_start, 1)
    log_path.write_text(json.dumps(training_log, indent=2) + "\n")
    log(f"saved {out} ({training_log['size_on_disk_mb']} MB) in {timings['total']} s")
    return training_log


if __name__ == "__main__":
    main()
