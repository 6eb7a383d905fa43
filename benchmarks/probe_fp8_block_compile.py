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
  block's time).

Times are interleaved rounds of back-to-back calls (the GPU sits at its power cap), median per variant; each
variant's block residual (output minus input) is compared with the first variant's (SNR, dB). Compile seconds are the
first call's. Prints a table, writes JSON to $OUT/probe_fp8_block_compile.json and appends a section to --results.

    python benchmarks/probe_fp8_block_compile.py [--variants apart,joined,...] [--rounds 4] [--results F]
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

sys.path.insert(0, os.path.dirname(__file__))
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
)
LEFT_APART = {"gate|up": ("ff", ()), "k|v": ("attn", (("to_q", "to_gate"),)), "q|gate": ("attn", (("to_k", "to_v"),))}
"""`joined but G`: the submodule whose `joinable` declaration is narrowed on the probe's copy, and what is left."""


class Stack(nn.Module):
    """Puts a block at `transformer_blocks.0` so the quantization patterns address it as in the model."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList([block])


def build(variant: str, block: Krea2TransformerBlock):
    """The quantized block of `variant` (a copy) and its compiled callable."""
    import torch._inductor.config as inductor_config

    copied = copy.deepcopy(block)
    for group, (child, joinable) in LEFT_APART.items():
        if variant.endswith(f"but {group}"):
            getattr(copied, child).joinable = joinable  # the instance's declaration narrows the class's
    stack = Stack(copied)
    quantize_transformer(stack, QuantizationSpec(join_projections=variant.startswith("joined")))
    mode = "max-autotune-no-cudagraphs" if "max-autotune" in variant else None
    options = {
        "triton.enable_persistent_tma_matmul": "TMA" in variant,
        "coordinate_descent_tuning": "coordinate-descent" in variant,
    }
    compiled = torch.compile(stack.transformer_blocks[0], fullgraph=True, mode=mode)

    def call(*args):
        with inductor_config.patch(options):  # read while compiling, on the first call
            return compiled(*args)

    return stack, call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS[:5]))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per variant and round")
    ap.add_argument("--tokens", type=int, default=4144)
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
            built[variant] = (stack, call)
            rows[variant] = {"variant": variant, "compile_s": round(compile_s, 1), "residual": (out - x).float()}
            print(f"built {variant}: first call {compile_s:.1f} s", flush=True)
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                call = built[variant][1]
                times[variant].append(timed_ms(lambda c=call: c(*inputs), args.seconds))
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
            json.dump(table, f, indent=1)
    import torchao  # optional dependency: only its version is printed

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    text = "\n".join(
        [
            f"\n## An FP8 block's joined projections and compile mode (`probe_fp8_block_compile.py`), {stamp}\n",
            f"Command: `{command_line('probe_fp8_block_compile.py', argv)}`  ",
            f"Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, torchao {torchao.__version__}; one "
            f"full-size block, random weights, {args.tokens} tokens, FP8 default, compiled; median of {args.rounds} "
            f"interleaved rounds of {args.seconds} s back to back\n",
            *markdown_table(table),
        ]
    )
    publish(text, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
