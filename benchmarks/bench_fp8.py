"""FP8 (torchao per-row e4m3) on Krea-2: which layer groups cost fidelity, and what each costs in speed.

- fidelity: the embedded checkpoint in bf16 on the GPU, 16 held-out prompts with their seeds, Raw 28 steps CFG 4.5
  and 8 steps without CFG: PSNR of FP8 against bf16 (same seed) for every block linear in FP8, for one layer group
  alone in FP8, and for all but one group; plus FP8 together with the recommended cache settings (curved 0.4)
  and that cache setting alone, each against uncached bf16.
- block: one full-size Krea-2 block (width 6144, 4144 tokens), compiled, back to back: bf16, every linear in FP8,
  and FP8 with each group kept in bf16 (ms per block).

    python benchmarks/bench_fp8.py --results benchmarks/RESULTS.md          # GPU with compute capability >= 8.9
    python benchmarks/bench_fp8.py --sections fidelity --exclude attn_gate  # the fidelity of one exclusion choice

Prints a table per section, appends them to --results, writes $OUT/bench_fp8.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from publish import command_line, publish  # noqa: E402

from dicache.models.krea2 import Krea2Pipeline  # noqa: E402
from dicache.models.krea2.pipeline import EMBEDDED_CHECKPOINT  # noqa: E402
from dicache.quantization import LAYER_GROUPS, QuantizationSpec  # noqa: E402
from dicache.sweep.metrics import psnr  # noqa: E402
from dicache.tuning import RECOMMENDED_FAMILY  # noqa: E402

LINEAR_GROUPS = ("attn_qkv", "attn_gate", "attn_out", "ff_in", "ff_out")
RECOMMENDED = {**RECOMMENDED_FAMILY, "scm_compute_fraction": 0.4}  # README "Recommended settings"
SCHEDULES = {"raw28": (28, 4.5, "raw"), "turbo8": (8, 1.0, "turbo")}


def heldout() -> list[tuple[str, int]]:
    data = json.loads((EMBEDDED_CHECKPOINT / "heldout_prompts.json").read_text())
    return [(p["prompt"], int(p["seed"])) for p in data["prompts"] if p.get("split") == "heldout"]


def sample(pipe: Krea2Pipeline, samples, steps: int, scale: float, variant: str, cache: dict | None) -> torch.Tensor:
    """Images `(N, 3, H, W)` in [0, 1], one per (prompt, seed), all in one batch (each row drawn from its own seed):
    eager FP8 linears pay a fixed cost per call, so one batched call per step keeps this section short."""
    import dicache

    height, width = pipe.default_size
    latents = torch.cat(
        [pipe.initial_latents(1, height, width, torch.Generator("cpu").manual_seed(seed)) for _, seed in samples]
    )
    if cache is not None:
        dicache.enable(pipe, cache)
    images = pipe(
        [prompt for prompt, _ in samples],
        latents=latents,
        num_inference_steps=steps,
        guidance_scale=scale,
        variant=variant,
        output_type="pt",
    ).images
    if cache is not None:
        dicache.disable(pipe)
    return images.float().cpu()


def section_fidelity(args, results: dict) -> list[dict]:
    samples = heldout()[: args.num_prompts]
    configs: dict[str, tuple[QuantizationSpec | None, dict | None]] = {}
    if args.exclude:  # one exclusion choice (the default's: QuantizationSpec()), alone and with the cache
        spec = QuantizationSpec(exclude=tuple(args.exclude))
        configs[f"fp8 excluding {' '.join(args.exclude)}"] = (spec, None)
        configs[f"fp8 excluding {' '.join(args.exclude)} + cache curved 0.4"] = (spec, RECOMMENDED)
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


def section_block(args, results: dict) -> list[dict]:
    import copy

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
    variants: dict[str, QuantizationSpec | None] = {"bf16": None, "fp8 all": QuantizationSpec(exclude=())}
    costly = costliest_groups(results.get("fidelity") or [], 2)
    for i in range(len(costly)):  # the costliest group kept in bf16, then the two costliest
        variants[f"fp8 all but {' '.join(costly[: i + 1])}"] = QuantizationSpec(exclude=tuple(costly[: i + 1]))
    if args.exclude:
        variants[f"fp8 excluding {' '.join(args.exclude)}"] = QuantizationSpec(exclude=tuple(args.exclude))
    rows, bf16_ms = [], None
    with torch.no_grad():
        for label, spec in variants.items():
            stack = Stack(copy.deepcopy(block))
            if spec is not None:
                quantize_transformer(stack, spec)
            compiled = torch.compile(stack.transformer_blocks[0], fullgraph=True)
            ms = timed_ms(lambda c=compiled: c(x, temb, rope))
            bf16_ms = bf16_ms or ms
            rows.append({"config": label, "ms_per_block": round(ms, 3), "speedup_vs_bf16": round(bf16_ms / ms, 3)})
            print(f"block: {rows[-1]}", flush=True)
            del stack, compiled
            torch.cuda.empty_cache()
    results["block_note"] = (
        "one full-size block (6144 wide, 48/12 heads, SwiGLU 16384), 4144 tokens, compiled, back to back; "
        "first/last-block exclusion costs 2/28 of (bf16 - fp8 all) per forward"
    )
    return rows


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
    for name in ("fidelity", "block"):
        rows = results.get(name)
        if not rows:
            continue
        lines.append(f"### {name}: {results.get(name + '_note', '')}\n")
        keys = list(rows[0])
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="fidelity,block")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument(
        "--exclude", nargs="+", default=None, help=f"an exclusion choice to add ({', '.join(LAYER_GROUPS)})"
    )
    parser.add_argument("--results", default=None)
    args = parser.parse_args(argv)
    import torchao

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "torchao": torchao.__version__}
    out = pathlib.Path(os.environ.get("OUT", ".")) / "bench_fp8.json"
    if "fidelity" not in args.sections and out.is_file():  # a block-only run picks its groups from an earlier one
        results["fidelity"] = json.loads(out.read_text()).get("fidelity")
    for section in args.sections.split(","):
        results[section] = {"fidelity": section_fidelity, "block": section_block}[section](args, results)
        out.write_text(json.dumps(results, indent=1))
        print(markdown({**results, "block": results.get("block")}, "(partial)"), flush=True)
    command = command_line("bench_fp8.py", argv)
    publish(markdown(results, command), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
