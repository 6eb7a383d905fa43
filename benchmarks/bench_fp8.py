"""FP8 (torchao per-row e4m3) on Krea-2: which layer groups cost fidelity, why, and what each costs in speed.

- layers (any device; CPU emulation): per layer group, each block linear's output SNR on the inputs it really sees,
  for per-row, 1x128/128x128-block and Hadamard-rotated scaling, SmoothQuant's migration, and the weights' and the
  activations' rounding alone; how far the largest input channel stands out.
- emulated (any device): end-to-end PSNR against bf16 with chosen linears in emulated FP8 (`--emulate SCHEME:GROUPS`,
  e.g. `row:all`, `hadamard:all`, `row:*.attn.to_q`, `row:text_encoder`).
- fidelity (GPU, torchao): the embedded checkpoint in bf16 on the GPU, 16 held-out prompts with their seeds, Raw 28
  steps CFG 4.5 and 8 steps without CFG: PSNR of FP8 against bf16 (same seed) for every block linear in FP8, for one
  layer group alone in FP8, and for all but one group (or for the `--compare` choices); plus FP8 together with the
  recommended cache settings (curved 0.4) and that cache setting alone, each against uncached bf16.
- block (GPU): one full-size Krea-2 block (width 6144, 4144 tokens), compiled, back to back: bf16, the FP8 default,
  every linear in FP8 and each `--compare` choice (ms per block, and the block residual's SNR against bf16).

    python benchmarks/bench_fp8.py --results benchmarks/RESULTS.md          # GPU with compute capability >= 8.9
    python benchmarks/bench_fp8.py --sections fidelity,block --compare default none attn_qkv,attn_out  # issue 27
    python benchmarks/bench_fp8.py --sections layers,emulated --device cpu --schedules turbo8   # CPU (an hour)

Prints a table per section, appends them to --results, writes $OUT/bench_fp8.json. On the GPU machine the whole of
the fast path's FP8 step is `bash benchmarks/gpu/fast_path.sh fp8` (wheels to carry: see that script).
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import math
import os
import pathlib
import platform
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from publish import command_line, markdown_table, publish  # noqa: E402

from dicache.models.krea2 import Krea2Pipeline  # noqa: E402
from dicache.models.krea2.pipeline import EMBEDDED_CHECKPOINT  # noqa: E402
from dicache.quantization import (  # noqa: E402
    DEFAULT_FP8_INCLUDE,
    LAYER_GROUPS,
    TEXT_ENCODER_FP8_INCLUDE,
    QuantizationSpec,
    parse_quantization,
)
from dicache.quantization.fp8_emulation import ACTIVATION_BLOCK, WEIGHT_BLOCK, EmulatedScheme  # noqa: E402
from dicache.quantization.hadamard import DEFAULT_MAX_BLOCK  # noqa: E402
from dicache.sweep.metrics import psnr  # noqa: E402
from dicache.tuning import RECOMMENDED_FAMILY  # noqa: E402

LINEAR_GROUPS = ("attn_qkv", "attn_gate", "attn_out", "ff_in", "ff_out")
RECOMMENDED = {**RECOMMENDED_FAMILY, "scm_compute_fraction": 0.4}  # README "Recommended settings"
SCHEDULES = {"raw28": (28, 4.5, "raw"), "turbo8": (8, 1.0, "turbo")}


def heldout() -> list[tuple[str, int]]:
    data = json.loads((EMBEDDED_CHECKPOINT / "heldout_prompts.json").read_text())
    return [(p["prompt"], int(p["seed"])) for p in data["prompts"] if p.get("split") == "heldout"]


def sample(
    pipe: Krea2Pipeline, samples, steps: int, scale: float, variant: str, cache: dict | None, embeds=None
) -> torch.Tensor:
    """Images `(N, 3, H, W)` in [0, 1], one per (prompt, seed), all in one batch (each row drawn from its own seed):
    eager FP8 linears pay a fixed cost per call, so one batched call per step keeps this section short. `embeds`:
    `PromptEmbeddings` to reuse (the text encoder is not quantised; on a CPU it costs more than the sampling)."""
    import dicache

    height, width = pipe.default_size
    latents = torch.cat(
        [pipe.initial_latents(1, height, width, torch.Generator("cpu").manual_seed(seed)) for _, seed in samples]
    )
    if cache is not None:
        dicache.enable(pipe, cache)
    text = {"prompt": [prompt for prompt, _ in samples]} if embeds is None else embeds.call_kwargs(scale > 1.0)
    images = pipe(
        **text,
        latents=latents,
        num_inference_steps=steps,
        guidance_scale=scale,
        variant=variant,
        output_type="pt",
    ).images
    if cache is not None:
        dicache.disable(pipe)
    return images.float().cpu()


class PromptEmbeddings:
    """The samples' prompt (and empty negative prompt) encodings, computed once."""

    def __init__(self, pipe: Krea2Pipeline, samples) -> None:
        self.cond = pipe.encode_prompt([prompt for prompt, _ in samples])
        self.uncond = pipe.encode_prompt([""] * len(samples))

    def call_kwargs(self, cfg: bool) -> dict:
        kwargs = {"prompt_embeds": self.cond[0], "prompt_embeds_mask": self.cond[1]}
        if cfg:
            kwargs.update(negative_prompt_embeds=self.uncond[0], negative_prompt_embeds_mask=self.uncond[1])
        return kwargs


def exclusion_choices(args) -> dict[str, QuantizationSpec]:
    """`--exclude` (one FP8 choice, groups as separate words) and `--compare` (choices `[METHOD:]GROUPS`: METHOD fp8
    (the default) or int8; GROUPS comma-separated; "default": the method's default exclusions, "none": every block
    linear quantised), by label."""
    choices = [("fp8", args.exclude)] if args.exclude else []
    for choice in args.compare or []:
        method, _, groups = choice.rpartition(":")
        choices.append((method or "fp8", [] if groups == "default" else groups.split(",")))
    specs = {}
    for method, groups in choices:
        spec = parse_quantization(method, groups or None)
        specs[f"{method} excluding {' '.join(spec.exclude) or 'nothing'}"] = spec
    return specs


def section_fidelity(args, results: dict) -> list[dict]:
    samples = heldout()[: args.num_prompts]
    configs: dict[str, tuple[QuantizationSpec | None, dict | None]] = {}
    choices = exclusion_choices(args)
    if choices:  # given exclusion choices alone, the first also with the cache
        for index, (label, spec) in enumerate(choices.items()):
            configs[label] = (spec, None)
            if index == 0:
                configs[f"{label} + cache curved 0.4"] = (spec, RECOMMENDED)
        configs["cache curved 0.4 (bf16)"] = (None, RECOMMENDED)
        return _fidelity_rows(args, results, samples, configs)
    configs = {
        "fp8 all block linears": (QuantizationSpec(exclude=()), None),
        "cache curved 0.4 (bf16)": (None, RECOMMENDED),
        "fp8 all + cache curved 0.4": (QuantizationSpec(exclude=()), RECOMMENDED),
    }
    for group in LINEAR_GROUPS:
        others = tuple(g for g in LINEAR_GROUPS if g != group)
        configs[f"fp8 only {group}"] = (QuantizationSpec(exclude=others), None)
        configs[f"fp8 all but {group}"] = (QuantizationSpec(exclude=(group,)), None)
    configs["fp8 all but first+last block"] = (QuantizationSpec(exclude=("first_block", "last_block")), None)
    return _fidelity_rows(args, results, samples, configs)


def _fidelity_rows(args, results: dict, samples, configs: dict) -> list[dict]:
    base = Krea2Pipeline.from_pretrained(device="cuda")
    base.set_progress_bar_config(disable=True)
    refs = {name: sample(base, samples, *sched, None) for name, sched in SCHEDULES.items()}
    rows = []
    for label, (spec, cache) in configs.items():
        pipe = base
        if spec is not None:
            pipe = Krea2Pipeline.from_pretrained(device="cuda")
            pipe.set_progress_bar_config(disable=True)
            pipe.quantize(spec)
        row = {"config": label}
        for name, sched in SCHEDULES.items():
            values = psnr(sample(pipe, samples, *sched, cache), refs[name])
            row[f"{name}_mean_dB"] = round(sum(values) / len(values), 2)
            row[f"{name}_worst_dB"] = round(min(values), 2)
        rows.append(row)
        print(f"fidelity: {row}", flush=True)
    results["fidelity_note"] = (
        f"embedded checkpoint, bf16 on {torch.cuda.get_device_name()}, {len(samples)} held-out prompts (own seeds) "
        "in one batch, 128 px; PSNR against bf16 uncached at the same seed"
    )
    return rows


EMULATED_SCHEMES = {
    "row": EmulatedScheme(),
    "block": EmulatedScheme(ACTIVATION_BLOCK, WEIGHT_BLOCK),
    "hadamard": EmulatedScheme(rotation_block=DEFAULT_MAX_BLOCK),
    "int8": EmulatedScheme(fmt="int8"),
}
"""FP8 scalings compared in emulation: torchao's per-row (activations per token, weights per output channel; the
product's), 1x128 activation / 128x128 weight blocks, per-row after a Hadamard rotation of the input axis, and
symmetric INT8 per row (torchao's dynamic INT8: same scale layout, 8-bit integers instead of e4m3)."""
EMULATED_DEFAULT = (
    "row:all", "block:all", "hadamard:all", "row:attn_qkv", "row:*.attn.to_q", "row:*.attn.to_k", "row:*.attn.to_v",
    "row:attn_out", "row:attn_gate,ff_in,ff_out", "hadamard:attn_qkv,attn_out",
)  # fmt: skip


TEXT_ENCODER = "text_encoder"


def section_emulated(args, results: dict) -> list[dict]:
    """Emulated FP8 (`dicache.fp8_emulation`) on any device: for each `SCHEME:GROUPS` of `--emulate`, the block
    linears matching GROUPS ("all", group names or globs, comma-separated; "text_encoder": the text encoder's
    decoder-layer linears, as `--text-encoder-quantization fp8` picks them) compute in emulated FP8 with SCHEME;
    PSNR against the same pipeline in its own dtype (bf16), same seeds."""
    from dicache.quantization.fp8_emulation import emulate_fp8, restore_linears

    samples = heldout()[: args.num_prompts]
    pipe = Krea2Pipeline.from_pretrained(device=args.device, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    embeds = PromptEmbeddings(pipe, samples)
    schedules = {name: SCHEDULES[name] for name in args.schedules.split(",")}
    refs = {name: sample(pipe, samples, *sched, None, embeds) for name, sched in schedules.items()}
    rows = []
    for config in args.emulate:
        emulated = []  # (model, names) per part; a later part re-emulates the linears it shares with an earlier one
        attention = None
        for part in config.split("+"):
            scheme, _, groups = part.partition(":")
            if scheme == ATTENTION_SCHEME:
                attention = _emulate_attention(pipe.transformer, groups)
                continue
            model, names = _emulated_linears(pipe, groups)
            emulate_fp8(model, names, EMULATED_SCHEMES[scheme])
            emulated.append((model, names))
        names = sorted({name for _, part_names in emulated for name in part_names})
        encoder_changed = any(model is not pipe.transformer for model, _ in emulated)
        config_embeds = PromptEmbeddings(pipe, samples) if encoder_changed else embeds
        row = {"config": config, "linears": len(names)}
        for name, sched in schedules.items():
            values = psnr(sample(pipe, samples, *sched, None, config_embeds), refs[name])
            row[f"{name}_mean_dB"] = round(sum(values) / len(values), 2)
            row[f"{name}_worst_dB"] = round(min(values), 2)
        for model, _ in emulated:
            restore_linears(model)
        for module in attention or ():
            del module.kernel
        rows.append(row)
        print(f"emulated: {row}", flush=True)
    results["emulated_note"] = (
        f"embedded checkpoint in bf16 on {args.device}, FP8 e4m3 (INT8 for int8: parts) emulated in float32 (exact "
        "accumulation; dicache.fp8_emulation), "
        f"{len(samples)} held-out prompts (own seeds) in one batch, 128 px; PSNR against "
        "bf16 at the same seed"
    )
    return rows


ATTENTION_SCHEME = "attention"
"""`--emulate` part `attention:QK_FMT[,nosmooth][,pvbf16][,vhead]`: the transformer blocks' attention in emulated
8-bit (`dicache.fp8_attention_emulation`): Q/K in QK_FMT (int8 or e4m3), K smoothed unless `nosmooth`, P and V in e4m3
unless `pvbf16`, V scaled per channel unless `vhead`."""


ATTENTION_FLAGS = ("nosmooth", "pvbf16", "vhead")


def _attention_scheme(options: str):
    """The `Fp8AttentionScheme` of an `attention:` part's OPTIONS; ValueError naming a bad format or flag."""
    from dicache.quantization.fp8_attention_emulation import Fp8AttentionScheme

    fmt, *flags = options.split(",")
    unknown = sorted(set(flags) - set(ATTENTION_FLAGS))
    if unknown:
        raise ValueError(
            f"attention:{options}: unknown flag(s) {', '.join(unknown)}; allowed: {', '.join(ATTENTION_FLAGS)}"
        )
    return Fp8AttentionScheme(
        qk_fmt=fmt,
        smooth_k="nosmooth" not in flags,
        pv_fmt="bf16" if "pvbf16" in flags else "e4m3",
        v_per_channel="vhead" not in flags,
    )


def _emulate_attention(transformer: torch.nn.Module, options: str) -> list[torch.nn.Module]:
    """Give every block attention that uses the class's kernel (not the text path's) the emulated 8-bit kernel;
    returns the modules changed (delete their `kernel` to undo)."""
    import functools

    from dicache.models.krea2.transformer import Attention
    from dicache.quantization.fp8_attention_emulation import fp8_attention_reference

    kernel = functools.partial(fp8_attention_reference, scheme=_attention_scheme(options))
    changed = [m for m in transformer.modules() if isinstance(m, Attention) and "kernel" not in vars(m)]
    for module in changed:
        module.kernel = kernel
    return changed


def _emulated_linears(pipe: Krea2Pipeline, groups: str) -> tuple[torch.nn.Module, list[str]]:
    """The model and linear names an `--emulate` part's GROUPS select."""
    from dicache.quantization import selected_linears

    if groups == TEXT_ENCODER:  # the text encoder's decoder-layer linears: its outputs change, so re-encode
        model = pipe.text_encoder.text_encoder
        names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        return model, [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in TEXT_ENCODER_FP8_INCLUDE)]
    model = pipe.transformer  # among the block linears only, as `--quantization-exclude` selects them
    blocks = set(selected_linears(model, QuantizationSpec(exclude=())))
    include = DEFAULT_FP8_INCLUDE if groups == "all" else tuple(groups.split(","))
    return model, [n for n in selected_linears(model, QuantizationSpec(include=include, exclude=())) if n in blocks]


def section_layers(args, results: dict) -> list[dict]:
    """Per layer group, on the inputs the block linears really see (a Raw 28-step CFG generation of
    `--layer-prompts` held-out prompts, steps 0, 9, 18, 27, both branches): each linear's output SNR against its
    exact output for each emulated scaling (plus SmoothQuant's scale migration with alpha 0.5 and the rounding of the
    weights alone and of the activations alone), and how far the largest input channel stands out (max / median of
    the per-channel maxima; outliers are what finer scales, rotations and smoothing are for)."""
    from dicache.quantization import selected_linears
    from dicache.quantization.fp8_emulation import fake_quantize
    from dicache.quantization.hadamard import HadamardRotation

    pipe = Krea2Pipeline.from_pretrained(device=args.device, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    modules = dict(pipe.transformer.named_modules())
    names = selected_linears(pipe.transformer, QuantizationSpec(exclude=()))
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    calls = {"n": 0}
    kept_calls = {2 * step + branch for step in (0, 9, 18, 27) for branch in (0, 1)}

    def keep(name):
        def hook(module, args_):
            if calls["n"] in kept_calls:
                inputs[name].append(args_[0].detach().reshape(-1, args_[0].shape[-1]).float())

        return hook

    handles = [modules[name].register_forward_pre_hook(keep(name)) for name in names]
    handles.append(pipe.transformer.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1)))
    for prompt, seed in heldout()[: args.layer_prompts]:
        calls["n"] = 0
        pipe([prompt], seed=seed, num_inference_steps=28, guidance_scale=4.5, variant="raw", output_type="latent")
    for handle in handles:
        handle.remove()

    def snr(exact, approx):
        return 10 * math.log10(float(exact.pow(2).sum() / (exact - approx).pow(2).sum()))

    def smooth(x, w, alpha=0.5):
        s = x.abs().amax(0).clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)
        return x / s, w * s

    schemes = {name: EMULATED_SCHEMES[name] for name in ("row", "block", "hadamard")}
    per_group: dict[str, dict[str, list[float]]] = {}
    for name in names:
        x, w = torch.cat(inputs[name]), modules[name].weight.detach().float()
        exact = x @ w.T
        group = next(g for g in LINEAR_GROUPS if any(fnmatch.fnmatchcase(name, p) for p in LAYER_GROUPS[g]))
        values = per_group.setdefault(group, {})
        for label, scheme in schemes.items():
            xs, ws = x, w
            if scheme.rotation_block is not None:
                rotation = HadamardRotation(x.shape[-1], scheme.rotation_block)
                xs, ws = rotation(x), rotation(w)
            approx = fake_quantize(xs, scheme.activation_block) @ fake_quantize(ws, scheme.weight_block).T
            values.setdefault(f"{label}_dB", []).append(snr(exact, approx))
        xs, ws = smooth(x, w)
        values.setdefault("smoothquant_dB", []).append(snr(exact, fake_quantize(xs) @ fake_quantize(ws).T))
        values.setdefault("weights_only_dB", []).append(snr(exact, x @ fake_quantize(w).T))
        values.setdefault("activations_only_dB", []).append(snr(exact, fake_quantize(x) @ w.T))
        maxima = x.abs().amax(0)
        values.setdefault("channel_max_over_median", []).append(float(maxima.max() / maxima.median()))
    rows = []
    for group, values in per_group.items():
        rows.append({"group": group, **{k: round(sum(v) / len(v), 2) for k, v in values.items()}})
        print(f"layers: {rows[-1]}", flush=True)
    results["layers_note"] = (
        f"embedded checkpoint in bf16 on {args.device}; inputs of every block linear during Raw 28 steps CFG 4.5 of "
        f"{args.layer_prompts} held-out prompts (steps 0, 9, 18, 27, cond and uncond); output SNR against the exact "
        "product, mean over the group's linears; FP8 emulated (dicache.fp8_emulation)"
    )
    return rows


def timed_ms(fn, seconds: float = 3.0) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        n += 5
    return (time.perf_counter() - start) / n * 1e3


FUSED_INT8 = "int8 all, int_mm fused with its rescale"
"""The block-section variant compiled with inductor's `force_fuse_int_mm_with_mul` (torchao's recommended setting:
the int32 GEMM and its rescale in one Triton kernel instead of cuBLAS's GEMM and a separate elementwise kernel)."""


def section_block(args, results: dict) -> list[dict]:
    import copy

    import torch._inductor.config

    from dicache.models.krea2.transformer import Krea2TransformerBlock, keeps_fp32
    from dicache.models.loading import materialize_random
    from dicache.quantization import quantize_transformer

    with torch.device("meta"):
        block = Krea2TransformerBlock(6144, 16384, 48, 12, 1e-5)
    materialize_random(block, device="cuda", dtype=torch.bfloat16, keep_fp32=keeps_fp32)
    with torch.no_grad():
        block.scale_shift_table.normal_(0, 0.05)

    class Stack(torch.nn.Module):  # the patterns address `transformer_blocks.N.*`
        def __init__(self, b):
            super().__init__()
            self.transformer_blocks = torch.nn.ModuleList([b])

    tokens = 4144
    x = torch.randn(1, tokens, 6144, device="cuda", dtype=torch.bfloat16)
    temb = torch.randn(1, 1, 6 * 6144, device="cuda", dtype=torch.bfloat16) * 0.1
    angles = torch.rand(tokens, 64, device="cuda") * 6.28
    rope = (angles.cos(), angles.sin())
    variants: dict[str, QuantizationSpec | None] = {"bf16": None, "fp8 default": QuantizationSpec()}
    variants["fp8 all"] = QuantizationSpec(exclude=())
    variants["int8 all"] = QuantizationSpec("int8", exclude=())
    variants[FUSED_INT8] = QuantizationSpec("int8", exclude=())
    costly = costliest_groups(results.get("fidelity") or [], 2)
    for i in range(len(costly)):  # the costliest group kept in bf16, then the two costliest
        variants[f"fp8 all but {' '.join(costly[: i + 1])}"] = QuantizationSpec(exclude=tuple(costly[: i + 1]))
    for label, spec in exclusion_choices(args).items():  # a choice equal to a variant above is timed once
        if spec not in variants.values():
            variants[label] = spec
    rows, bf16_ms, reference = [], None, None
    with torch.no_grad():
        for label, spec in variants.items():
            stack = Stack(copy.deepcopy(block))
            if spec is not None:
                quantize_transformer(stack, spec)
            compiled = torch.compile(stack.transformer_blocks[0], fullgraph=True)
            with torch._inductor.config.patch(force_fuse_int_mm_with_mul=label == FUSED_INT8):
                ms = timed_ms(lambda c=compiled: c(x, temb, rope))
                out = compiled(x, temb, rope).float() - x.float()  # the block's own contribution (the residual)
            reference = out if reference is None else reference
            bf16_ms = bf16_ms or ms
            row = {"config": label, "ms_per_block": round(ms, 3), "speedup_vs_bf16": round(bf16_ms / ms, 3)}
            row["residual_snr_dB"] = round(snr_db(out, reference), 2) if out is not reference else None
            rows.append(row)
            print(f"block: {rows[-1]}", flush=True)
            del stack, compiled
            torch.cuda.empty_cache()
    results["block_note"] = (
        "one full-size block (6144 wide, 48/12 heads, SwiGLU 16384), random weights, 4144 tokens, compiled, back to "
        "back; residual_snr_dB: the block's output minus its input against bf16's (torchao's FP8 GEMMs, fast "
        "accumulation included, and INT8 GEMMs, at the full size's long inputs); first/last-block exclusion costs "
        "2/28 of "
        "(bf16 - fp8 all) per forward"
    )
    return rows


def snr_db(value: torch.Tensor, reference: torch.Tensor) -> float:
    """10 log10(|reference|² / |value - reference|²)."""
    return 10 * math.log10(float(reference.pow(2).sum() / (value - reference).pow(2).sum().clamp_min(1e-30)))


def costliest_groups(fidelity_rows: list[dict], count: int) -> list[str]:
    """The `count` layer groups whose FP8 alone costs the most PSNR (lowest mean over both schedules)."""
    scores = {}
    for row in fidelity_rows:
        label = row["config"]
        if label.startswith("fp8 only "):
            scores[label.removeprefix("fp8 only ")] = row["raw28_mean_dB"] + row["turbo8_mean_dB"]
    return sorted(scores, key=scores.get)[:count]


def markdown(results: dict, command: str) -> str:
    lines = [
        f"\n## FP8 fidelity and speed by layer group ({datetime.datetime.now():%Y-%m-%d %H:%M})\n",
        f"Command: `{command}`  ",
        f"Machine: {results['device']}, torch {results['torch']}, torchao {results['torchao']}\n",
    ]
    for name in ("layers", "emulated", "fidelity", "block"):
        rows = results.get(name)
        if not rows:
            continue
        lines.append(f"### {name}: {results.get(name + '_note', '')}\n")
        lines += [*markdown_table(rows, list(rows[0])), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="fidelity,block")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument(
        "--exclude", nargs="+", default=None, help=f"an exclusion choice to add ({', '.join(LAYER_GROUPS)}; none)"
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="CHOICE",
        help="choices to measure, each [METHOD:]GROUPS: METHOD fp8 (default) or int8; GROUPS comma-separated groups or "
        "globs kept in bf16, 'none' (every block linear quantised) or 'default' (the method's default)",
    )
    parser.add_argument("--device", default="cuda", help="layers / emulated sections: where to run (cpu works)")
    parser.add_argument("--layer-prompts", type=int, default=2, help="layers section: prompts whose inputs are kept")
    parser.add_argument("--schedules", default="raw28,turbo8", help=f"emulated section: of {', '.join(SCHEDULES)}")
    parser.add_argument(
        "--emulate",
        nargs="+",
        default=list(EMULATED_DEFAULT),
        metavar="SCHEME:GROUPS",
        help=f"emulated section: schemes {', '.join(EMULATED_SCHEMES)}; groups 'all' or comma-separated group names "
        "or globs",
    )
    parser.add_argument("--results", default=None)
    args = parser.parse_args(argv)
    unknown = sorted(
        {part.partition(":")[0] for config in args.emulate for part in config.split("+")}
        - set(EMULATED_SCHEMES)
        - {ATTENTION_SCHEME}
    )
    if unknown:
        allowed = ", ".join([*EMULATED_SCHEMES, ATTENTION_SCHEME])
        parser.error(f"--emulate: unknown scheme(s) {', '.join(unknown)}; allowed: {allowed}")
    for part in (part for config in args.emulate for part in config.split("+")):
        scheme, _, options = part.partition(":")
        if scheme == ATTENTION_SCHEME:
            try:
                _attention_scheme(options)
            except ValueError as exc:
                parser.error(f"--emulate: {exc}")
    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = "not installed"
    on_cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_cuda else f"{platform.machine()} CPU ({os.cpu_count()} cores)"
    results = {"device": device, "torch": torch.__version__, "torchao": torchao_version}
    out = pathlib.Path(os.environ.get("OUT", ".")) / "bench_fp8.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if "fidelity" not in args.sections and out.is_file():  # a block-only run picks its groups from an earlier one
        results["fidelity"] = json.loads(out.read_text()).get("fidelity")
    for section in args.sections.split(","):
        sections = {"layers": section_layers, "emulated": section_emulated}
        run = {**sections, "fidelity": section_fidelity, "block": section_block}[section]
        results[section] = run(args, results)
        out.write_text(json.dumps(results, indent=1))
        print(markdown({**results, "block": results.get("block")}, "(partial)"), flush=True)
    command = command_line("bench_fp8.py", argv)
    publish(markdown(results, command), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
