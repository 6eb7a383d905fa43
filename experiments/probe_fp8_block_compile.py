"""Probe: does inductor's GEMM autotuning, or joining the projections that share an input, speed up an FP8 block?

One full-size Krea-2 block (6144 wide, 48/12 heads, SwiGLU 16384), random weights, 4144 tokens (4096 image + 48
text), the FP8 default (`--quantization fp8`: attention k/v/out in bf16), compiled with `fullgraph=True`. Variants:

- `apart`: every projection its own GEMM (`QuantizationSpec(join_projections=False)`), inductor's default mode;
- `joined`: the product's default: q|gate (FP8, 6144 -> 12288), k|v (bf16, 6144 -> 3072) and the SwiGLU's gate|up
  (FP8, 6144 -> 32768) each one GEMM (`dicache.joint_linears`);
- `joined but gate|up`, `joined but k|v`, `joined but q|gate`: one group left apart, to see what each join brings;
- `apart max-autotune TMA`, `joined max-autotune TMA`: `mode="max-autotune-no-cudagraphs"` with
  `triton.enable_persistent_tma_matmul` (Hopper's persistent TMA templates, inductor's Triton templates for row-scaled
  FP8 GEMMs, timed against `_scaled_mm`). On 2026-12-03 its autotuning took over 4 min per block and picked
  `_scaled_mm` for every FP8 GEMM shape it timed (the best Triton template within 0.5 %);
- `joined coordinate-descent`: inductor's `coordinate_descent_tuning` (it tunes the block sizes of its own pointwise
  and reduction kernels: the norms, modulations, RoPE and the activations' FP8 rounding, about an eighth of an FP8
  block's time);
- `joined multi-kernel`, `joined persistent`: inductor's `triton.multi_kernel` 1 / 2: reductions over rows of up to
  16384 elements (the norms' 6144, the SwiGLU product's 16384) also as persistent kernels (each row read once, held
  in registers) and, with 1, the faster of persistent and looped picked by timing them on the first call; 2 takes the
  persistent one. By default inductor makes a reduction persistent up to 1024 elements a row, so these rows are read
  in loops, once per pass (norm, FP8 scale, output);
- `joined cuda-graph`: the joined block's compiled call captured once as a CUDA graph and replayed (the same kernels
  without the host launching them: what host-side gaps between kernels cost).

Times are interleaved rounds of back-to-back calls (the GPU sits at its power cap), median per variant; each
variant's block residual (output minus input) is compared with the first variant's (SNR, dB). Compile seconds are the
first call's. `--profile` adds, per variant, its kernels' GPU time per block call (torch.profiler over back-to-back
calls, kernels of one name summed), grouped as FP8 GEMM, bf16 GEMM, attention and inductor's own (Triton) kernels.
Prints tables, writes JSON to $OUT/probe_fp8_block_compile.json and appends a section to --results.

    python experiments/probe_fp8_block_compile.py [--variants apart,joined,...] [--rounds 4] [--profile] [--results F]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dicache.models.krea2.transformer import Krea2TransformerBlock, keeps_fp32  # noqa: E402
from dicache.models.loading import materialize_random  # noqa: E402
from dicache.quantization import QuantizationSpec, quantize_transformer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))  # bench_fp8, publish
from bench_fp8 import timed_ms  # noqa: E402  (mean ms per call of back-to-back calls over a few seconds)
from publish import command_line, markdown_table, publish  # noqa: E402

VARIANTS = (
    "apart",
    "joined",
    "joined but gate|up",
    "joined but k|v",
    "joined but q|gate",
    "apart max-autotune TMA",
    "joined max-autotune TMA",
    "joined coordinate-descent",
    "joined cuda-graph",
    "joined multi-kernel",
    "joined persistent",
)
LEFT_APART = {"gate|up": ("ff", ()), "k|v": ("attn", (("to_q", "to_gate"),)), "q|gate": ("attn", (("to_k", "to_v"),))}
"""`joined but G`: the submodule whose `joinable` declaration is narrowed on the probe's copy, and what is left."""


class Stack(nn.Module):
    """Puts a block at `transformer_blocks.0` so the quantization patterns address it as in the model."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList([block])


COMPILE_OPTIONS = {
    "max-autotune TMA": {
        "max_autotune": True,
        "coordinate_descent_tuning": True,
        "triton.enable_persistent_tma_matmul": True,
    },  # mode="max-autotune-no-cudagraphs" plus Hopper's persistent TMA templates
    "coordinate-descent": {"coordinate_descent_tuning": True},
    "multi-kernel": {"triton.multi_kernel": 1},
    "persistent": {"triton.multi_kernel": 2},
}
"""Inductor options of a variant whose name ends with the key. They go to `torch.compile(options=...)`, which makes a
backend of their own: a variant with options compiles anew (under `inductor_config.patch` around the call, dynamo
would reuse the first variant's graph, whose guards the copied block passes)."""


def build(variant: str, block: Krea2TransformerBlock):
    """The quantized block of `variant` (a copy) and its compiled callable."""
    copied = copy.deepcopy(block)
    for group, (child, joinable) in LEFT_APART.items():
        if variant.endswith(f"but {group}"):
            getattr(copied, child).joinable = joinable  # the instance's declaration narrows the class's
    stack = Stack(copied)
    quantize_transformer(stack, QuantizationSpec(join_projections=variant.startswith("joined")))
    options = next((o for suffix, o in COMPILE_OPTIONS.items() if variant.endswith(suffix)), None)
    return stack, torch.compile(stack.transformer_blocks[0], fullgraph=True, options=options)


def graphed(call, inputs):
    """`call(*inputs)` captured as one CUDA graph (after warm-up calls on a side stream); returns a callable that
    replays it and gives the captured output (the inputs must be the same tensors)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(*inputs)

    def replay(*_):
        graph.replay()
        return out

    return replay


def kernel_kind(name: str) -> str:
    """The group of a CUDA kernel's name: cuBLAS's scaled (FP8) GEMMs carry `qq` / `scale`, cuDNN's and flash's
    attention `sdpa` / `flash` / `fmha`, inductor's kernels start with `triton_`."""
    lowered = name.lower()
    if lowered.startswith("triton_"):  # before attention: a fused kernel's name lists the ops around it
        return "inductor"
    if any(key in lowered for key in ("sdpa", "flash", "fmha", "attention")):
        return "attention"
    if any(key in lowered for key in ("nvjet", "gemm", "xmma", "cutlass")):
        return "fp8 gemm" if ("qq" in lowered or "scale" in lowered or "e4m3" in lowered) else "bf16 gemm"
    return "other"


def kernel_times(call, inputs, calls: int = 20) -> list[dict]:
    """GPU microseconds per call of each kernel `call(*inputs)` launches, largest first (kernels of one name summed)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call(*inputs)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    starts, ends = [], []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time
            entry[1] += 1
            starts.append(event.time_range.start)
            ends.append(event.time_range.end)
    block_us = sum(total for total, _ in totals.values()) / calls
    span_us = (max(ends) - min(starts)) / calls
    rows = [
        {
            "kind": kernel_kind(name),
            "kernel": name[:100],
            "us_per_block": round(total / calls, 1),
            "launches": count // calls,
            "share": round(total / calls / block_us, 4),
        }
        for name, (total, count) in totals.items()
    ]
    return sorted(rows, key=lambda row: -row["us_per_block"]) + [{"kind": "span", "us_per_block": round(span_us, 1)}]


def kind_summary(kernels: list[dict]) -> dict[str, float]:
    """Microseconds per block call by kernel kind, their sum, and the span (first kernel's start to the last one's
    end, per call: the sum plus the GPU's idle gaps)."""
    summary: dict[str, float] = {}
    for row in kernels:
        summary[row["kind"]] = round(summary.get(row["kind"], 0.0) + row["us_per_block"], 1)
    span = summary.pop("span")
    return summary | {"total": round(sum(summary.values()), 1), "span": span}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS[:5]))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per variant and round")
    ap.add_argument("--tokens", type=int, default=4144)
    ap.add_argument("--profile", action="store_true", help="also each variant's kernels, GPU time per block call")
    ap.add_argument("--results", default=None)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; allowed: {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU with FP8 tensor cores")

    torch.manual_seed(0)
    with torch.device("meta"):
        block = Krea2TransformerBlock(6144, 16384, 48, 12, 1e-5)
    materialize_random(block, device="cuda", dtype=torch.bfloat16, keep_fp32=keeps_fp32)
    with torch.no_grad():
        block.scale_shift_table.normal_(0, 0.05)
    x = torch.randn(1, args.tokens, 6144, device="cuda", dtype=torch.bfloat16)
    temb = torch.randn(1, 1, 6 * 6144, device="cuda", dtype=torch.bfloat16) * 0.1
    angles = torch.rand(args.tokens, 64, device="cuda") * 6.28
    inputs = (x, temb, (angles.cos(), angles.sin()))

    built, rows = {}, {}
    with torch.inference_mode():
        for variant in variants:
            stack, call = build(variant, block)
            start = time.perf_counter()
            out = call(*inputs)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start
            if variant.endswith("cuda-graph"):
                call = graphed(call, inputs)
                out = call(*inputs)
            built[variant] = (stack, call)
            rows[variant] = {"variant": variant, "compile_s": round(compile_s, 1), "residual": (out - x).float()}
            print(f"built {variant}: first call {compile_s:.1f} s", flush=True)
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                call = built[variant][1]
                times[variant].append(timed_ms(lambda c=call: c(*inputs), args.seconds))
        profiles = {v: kernel_times(built[v][1], inputs) for v in variants} if args.profile else {}
    reference = rows[variants[0]]["residual"]
    base_ms = statistics.median(times[variants[0]])
    table = []
    for variant in variants:
        residual = rows[variant].pop("residual")
        ms = statistics.median(times[variant])
        noise = (residual - reference).pow(2).sum().item()
        snr = "identical" if noise == 0 else round(10 * torch.log10(reference.pow(2).sum() / noise).item(), 2)
        row = rows[variant] | {
            "ms_per_block": round(ms, 3),
            "rounds_ms": [round(t, 3) for t in times[variant]],
            f"speedup_vs_{variants[0]}": round(base_ms / ms, 4),
            f"residual_snr_dB_vs_{variants[0]}": snr if variant != variants[0] else None,
        }
        table.append(row)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "probe_fp8_block_compile.json"), "w") as f:
            json.dump({"variants": table, "kernels": profiles}, f, indent=1)
    profile_text = []
    if profiles:
        summaries = [{"variant": v} | kind_summary(kernels) for v, kernels in profiles.items()]
        heading = "GPU time per block call by kernel kind (us; torch.profiler, 20 back-to-back calls; span: first start"
        profile_text += ["", f"{heading} to last end):", ""]
        profile_text += markdown_table(summaries)
        for variant, kernels in profiles.items():
            profile_text += ["", f"Kernels of `{variant}` (largest first, those over 1 % of the block):", ""]
            profile_text += markdown_table([row for row in kernels if row.get("share", 0) >= 0.01])
    import torchao  # optional dependency: only its version is printed

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    text = "\n".join(
        [
            f"\n## An FP8 block's joined projections and compile mode (`probe_fp8_block_compile.py`), {stamp}\n",
            f"Command: `{command_line('probe_fp8_block_compile.py', argv, folder='experiments')}`  ",
            f"Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, torchao {torchao.__version__}; one "
            f"full-size block, random weights, {args.tokens} tokens, FP8 default, compiled; median of {args.rounds} "
            f"interleaved rounds of {args.seconds} s back to back\n",
            *markdown_table(table),
            *profile_text,
        ]
    )
    publish(text, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
