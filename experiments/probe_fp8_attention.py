"""Probe: is 8-bit attention (`fp8_attention_kernel.py`, a Triton kernel) faster than bf16 SDPA (cuDNN) on a full-size
Krea-2 block's attention, and how accurate is it?

Shapes of one Krea-2 block at 1024² (48 query / 12 key-value heads of 128, 4144 tokens: 4096 image + 48 text),
random bf16 inputs (Q and K RMS-normalised per head like the model's, K with a per-channel offset like trained keys).
For each scheme (Q/K in int8 or e4m3, P/V in e4m3 or bf16) and each kernel configuration (tiles, warps, stages):
milliseconds per call of back-to-back calls, interleaved over `--rounds` rounds (median; the GPU sits at its power
cap), TFLOP/s (4·Hq·S²·D), the output's SNR against float32 attention, and the largest difference from
`dicache.fp8_attention_emulation.fp8_attention_reference` (what the kernel must compute). Then the whole
`fp8_attention` (operands rounded by inductor-compiled torch ops + the kernel) against SDPA, compiled as in the model,
and a masked call's agreement.

    python experiments/probe_fp8_attention.py [--rounds 2] [--seconds 1] [--results F]

Prints a table, writes $OUT/probe_fp8_attention.json and appends a section to --results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton  # the kernel's (fp8_attention_kernel imports it too)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dicache.models.krea2.attention import gqa_attention  # noqa: E402
from dicache.quantization.fp8_attention_emulation import (  # noqa: E402
    Fp8AttentionScheme,
    fp8_attention_reference,
    quantize_attention_inputs,
)

sys.path.insert(0, os.path.dirname(__file__))  # fp8_attention_kernel
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))  # bench_fp8, publish
from bench_fp8 import timed_ms  # noqa: E402  (mean ms per call of back-to-back calls over a few seconds)
from fp8_attention_kernel import KernelConfig, fp8_attention, launch  # noqa: E402
from publish import command_line, markdown_table, publish  # noqa: E402

SCHEMES = {
    "int8 qk, e4m3 pv": Fp8AttentionScheme("int8", pv_fmt="e4m3"),
    "e4m3 qk, e4m3 pv": Fp8AttentionScheme("e4m3", pv_fmt="e4m3"),
    "int8 qk, bf16 pv": Fp8AttentionScheme("int8", pv_fmt="bf16"),
}
CONFIGS = (
    KernelConfig(128, 128, 8, 3),
    KernelConfig(128, 128, 8, 2),
    KernelConfig(128, 64, 8, 3),
    KernelConfig(128, 64, 4, 3),
    KernelConfig(128, 128, 4, 3),
    KernelConfig(64, 128, 4, 3),
    KernelConfig(128, 64, 8, 4),
    KernelConfig(256, 64, 8, 3),
)


def inputs(args, generator):
    def normed(heads, offset):
        x = torch.randn(1, heads, args.tokens, args.head_dim, device="cuda", generator=generator)
        x = x + offset
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    offset = torch.randn(1, args.kv_heads, 1, args.head_dim, device="cuda", generator=generator)
    q = normed(args.q_heads, 0.0)
    k = normed(args.kv_heads, offset)
    v = torch.randn(1, args.kv_heads, args.tokens, args.head_dim, device="cuda", generator=generator).bfloat16()
    return q, k, v


def snr_db(out: torch.Tensor, exact: torch.Tensor) -> float:
    err = (out.float() - exact).pow(2).mean()
    return round(10 * torch.log10(exact.pow(2).mean() / err).item(), 2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4144)
    parser.add_argument("--q-heads", type=int, default=48)
    parser.add_argument("--kv-heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--results", default=None)
    args = parser.parse_args(argv)

    generator = torch.Generator("cuda").manual_seed(0)
    q, k, v = inputs(args, generator)
    group = args.q_heads // args.kv_heads
    exact = F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    )
    flops = 4 * args.q_heads * args.tokens**2 * args.head_dim

    calls, rows = {}, {}
    calls["sdpa bf16 (cuDNN)"] = lambda: gqa_attention(q, k, v)
    rows["sdpa bf16 (cuDNN)"] = {"variant": "sdpa bf16 (cuDNN)", "snr_dB": snr_db(gqa_attention(q, k, v), exact)}
    for scheme_name, scheme in SCHEMES.items():
        operands = quantize_attention_inputs(q, k, v, scheme)
        reference = fp8_attention_reference(q, k, v, None, scheme).float()
        for config in CONFIGS:
            name = f"{scheme_name} · {config.block_m}x{config.block_n} w{config.warps} s{config.stages}"
            try:
                out = launch(*operands, None, torch.bfloat16, config)
                torch.cuda.synchronize()
            except Exception as exc:  # a configuration that does not fit (shared memory, registers)
                print(f"{name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            rows[name] = {
                "variant": name,
                "snr_dB": snr_db(out, exact),
                "max_diff_vs_reference": round((out.float() - reference).abs().max().item(), 5),
            }
            calls[name] = lambda operands=operands, config=config: launch(*operands, None, torch.bfloat16, config)
            print(rows[name], flush=True)

    compiled = torch.compile(fp8_attention, fullgraph=True)
    whole = "int8 qk, e4m3 pv · whole fp8_attention compiled (rounding + kernel)"
    out = compiled(q, k, v)
    rows[whole] = {"variant": whole, "snr_dB": snr_db(out, exact)}
    calls[whole] = lambda: compiled(q, k, v)
    sdpa_compiled = torch.compile(gqa_attention, fullgraph=True)
    sdpa_compiled(q, k, v)
    calls["sdpa bf16 (cuDNN) compiled"] = lambda: sdpa_compiled(q, k, v)
    rows["sdpa bf16 (cuDNN) compiled"] = {"variant": "sdpa bf16 (cuDNN) compiled"}

    mask = torch.ones(1, args.tokens, dtype=torch.bool, device="cuda")
    mask[:, -args.tokens // 3 :] = False
    masked = fp8_attention(q, k, v, mask).float()
    masked_ref = fp8_attention_reference(q, k, v, mask).float()
    mask_diff = (masked - masked_ref).abs().max().item()

    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            times[name].append(timed_ms(call, args.seconds))
    base = statistics.median(times["sdpa bf16 (cuDNN)"])
    for name, row in rows.items():
        ms = statistics.median(times[name])
        row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1), speedup_vs_sdpa=round(base / ms, 3))
    table = sorted(rows.values(), key=lambda r: r["ms"])
    keys = ["variant", "ms", "tflops", "speedup_vs_sdpa", "snr_dB", "max_diff_vs_reference"]
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    text = "\n".join(
        [
            f"\n## 8-bit attention against bf16 SDPA (`probe_fp8_attention.py`), {stamp}\n",
            f"Command: `{command_line('probe_fp8_attention.py', argv, folder='experiments')}`  ",
            f"Machine: {machine}; one full-size block's attention: {args.q_heads}/{args.kv_heads} heads of "
            f"{args.head_dim}, {args.tokens} tokens, random inputs; median of {args.rounds} interleaved rounds of "
            f"{args.seconds} s back to back\n",
            *markdown_table(table, keys),
            "",
            f"A third of the keys masked: largest difference between `fp8_attention` and its reference "
            f"{mask_diff:.5f}.",
            "",
        ]
    )
    publish(text, args.results)
    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "probe_fp8_attention.json"), "w") as fh:
        json.dump({"rows": table, "times_ms": times, "mask_max_diff": mask_diff, "machine": machine}, fh, indent=1)


if __name__ == "__main__":
    main()
