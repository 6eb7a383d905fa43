"""Probe: do fused projections pay at Krea-2's shapes? Times the block's GEMMs separately and fused (bf16, H200).

One block at 1024² with 48 valid text tokens multiplies M = 4144 rows by: q/gate/out (6144), k/v (1536), FFN gate/up
(16384) and down (16384 -> 6144). Fusing q|k|v|gate into one (6144 -> 15360) and gate|up into one (6144 -> 32768)
saves launches and may reach a better kernel. Prints a table; JSON to $OUT/probe_gemm_fusion.json.

    python experiments/probe_gemm_fusion.py [--tokens 4144] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F


def bench(fn, iters: int = 20) -> float:
    """Median seconds of `fn` with CUDA events (or wall clock on CPU)."""
    import time

    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
    else:
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4144)
    ap.add_argument("--width", type=int, default=6144)
    ap.add_argument("--kv", type=int, default=1536)
    ap.add_argument("--ffn", type=int, default=16384)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev, dt = torch.device(args.device), torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    m, d, kv, f = args.tokens, args.width, args.kv, args.ffn
    x = torch.randn(m, d, device=dev, dtype=dt)
    h = torch.randn(m, f, device=dev, dtype=dt)
    w = {
        n: torch.randn(o, d, device=dev, dtype=dt) * 0.01
        for n, o in [("q", d), ("k", kv), ("v", kv), ("g", d), ("o", d), ("fg", f), ("fu", f)]
    }
    w["down"] = torch.randn(d, f, device=dev, dtype=dt) * 0.01
    qkvg = torch.cat([w["q"], w["k"], w["v"], w["g"]])
    gu = torch.cat([w["fg"], w["fu"]])
    rows = {}

    def row(name, fn, flops):
        t = bench(fn)
        rows[name] = {"ms": round(t * 1e3, 4), "tflops": round(flops / t / 1e12, 1)}

    row("q,k,v,gate separate", lambda: [F.linear(x, w[n]) for n in ("q", "k", "v", "g")], 2 * m * d * (2 * d + 2 * kv))
    row("qkvg fused", lambda: F.linear(x, qkvg), 2 * m * d * (2 * d + 2 * kv))
    row("out proj", lambda: F.linear(x, w["o"]), 2 * m * d * d)
    row("ffn gate,up separate", lambda: [F.linear(x, w["fg"]), F.linear(x, w["fu"])], 2 * m * d * 2 * f)
    row("ffn gate|up fused", lambda: F.linear(x, gu), 2 * m * d * 2 * f)
    row("ffn down", lambda: F.linear(h, w["down"]), 2 * m * f * d)
    print(f"{'gemm':<24} {'ms':>8} {'TFLOP/s':>8}")
    for name, r in rows.items():
        print(f"{name:<24} {r['ms']:>8.3f} {r['tflops']:>8.1f}")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "probe_gemm_fusion.json"), "w") as fh:
        json.dump({"tokens": m, "device": str(dev), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
