"""Does one cuDNN attention plan serve every prompt length (torch's `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`), and at what
cost? (issue 41: the first request after ready paid its prompt length's plan, 50-75 ms.)

torch's cuDNN attention builds a plan per sequence length, per thread. With the variable set, calls whose q, k, v and
output are laid out `(B, S, H, D)` (BSHD) and have no attention bias run cuDNN's padded ("ragged") kernel, whose plan
is keyed by the lengths rounded up to a power of two: at 1024² every prompt length (4096 + n tokens, n <= 512) falls
in one plan. Two child processes, one per setting (the variable is read once per process), each measure at
Krea-2's full-size attention shapes:

- `sdpa`: eager `scaled_dot_product_attention`, q `(B, 48, 4096+n, 128)`, k/v `(B, 12, ...)` in BSHD memory: the
  first call at each new length and the steady time of one call; its error against float32 attention;
- `block`: one full-size Krea-2 block, FP8 as served (`--quantization fp8`), compiled as the server compiles it
  (symbolic length): the first call at each new length (what a request paid) and the steady time of one call.

The parent compares the two settings' outputs on the same seeded inputs and weights (SNR, dB) and appends a table to
--results.

    python experiments/probe_shared_attention_plans.py [--lengths 300,7,100,511,64] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # publish, bench_fp8

ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
SETTINGS = {"per-length plans": "0", "shared plans": "1"}
IMAGE_TOKENS = 4096  # 1024²


def synced_s(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def steady_ms(fn, calls: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def bshd(batch: int, seq: int, heads: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(batch, seq, heads, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
    return x.transpose(1, 2)


def child(lengths: list[int], out_dir: pathlib.Path) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dicache.models.krea2.latents import position_ids
    from dicache.models.krea2.transformer import Krea2Transformer, keeps_fp32
    from dicache.models.loading import materialize_random
    from dicache.quantization import QuantizationSpec, quantize_transformer

    rows: list[dict] = []
    generator = torch.Generator("cuda").manual_seed(0)
    for batch in (1, 2):
        for n in lengths:
            s = IMAGE_TOKENS + n
            q, k, v = bshd(batch, s, 48, generator), bshd(batch, s, 12, generator), bshd(batch, s, 12, generator)

            def call(q=q, k=k, v=v):
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            first = synced_s(call)
            row = {"what": "sdpa", "batch": batch, "n": n, "first_ms": round(first * 1e3, 2)}
            row["steady_ms"] = round(steady_ms(call), 3)
            if n == lengths[-1]:
                out = call().float()
                with sdpa_kernel([SDPBackend.MATH]):
                    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
                row["max_err_vs_fp32"] = float((out - ref).abs().max())
                row["mean_err_vs_fp32"] = float((out - ref).abs().mean())
                torch.save(out.cpu(), out_dir / f"sdpa-{batch}.pt")
            rows.append(row)
            print(row, flush=True)

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Krea2Transformer(num_layers=1)
    materialize_random(model, device="cuda", dtype=torch.bfloat16, keep_fp32=keeps_fp32)
    quantize_transformer(model, QuantizationSpec())
    model.compile_blocks()
    positions = position_ids(64, 64, torch.device("cuda"))
    temb = model.time_mod_proj(torch.nn.functional.gelu(model.time_embed(torch.ones(1, device="cuda"), model.dtype)))
    block = model.transformer_blocks[0]
    for index, n in enumerate(lengths):
        rope = model.rotary_emb(positions, num_leading_zeros=n)
        joint = torch.randn(1, IMAGE_TOKENS + n, model.hidden_size, device="cuda", generator=generator).to(model.dtype)
        model.mark_sequence_dynamic(joint, rope)

        def call(joint=joint, rope=rope):
            with torch.no_grad():
                return block(joint, temb, rope, None)

        first = synced_s(call)
        row = {"what": "fp8 block, compiled", "batch": 1, "n": n, "first_ms": round(first * 1e3, 2)}
        if index == 0:
            row["note"] = "compiles the block"
        row["steady_ms"] = round(steady_ms(call), 3)
        if n == lengths[-1]:
            torch.save(call().float().cpu(), out_dir / "block.pt")
        rows.append(row)
        print(row, flush=True)
    (out_dir / "rows.json").write_text(json.dumps(rows))


def snr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other).pow(2).mean()
    return float("inf") if noise == 0 else round(float(10 * torch.log10(reference.pow(2).mean() / noise)), 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="300,7,100,511,64", help="prompt lengths n (joint length 4096 + n)")
    p.add_argument("--results", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.child:
        child(lengths, pathlib.Path(args.child))
        return 0
    from publish import command_line, markdown_table, publish

    table, outputs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, value in SETTINGS.items():
            folder = pathlib.Path(tmp, value)
            folder.mkdir()
            env = {**os.environ, ENV: value}
            cmd = [sys.executable, __file__, "--lengths", args.lengths, "--child", str(folder)]
            subprocess.run(cmd, env=env, check=True)
            for row in json.loads((folder / "rows.json").read_text()):
                table.append({"setting": name, **row})
            outputs[name] = {f.stem: torch.load(f) for f in folder.glob("*.pt")}
    per, shared = outputs["per-length plans"], outputs["shared plans"]
    agreement = {key: snr_db(per[key], shared[key]) for key in per}
    print("SNR of the shared plans' outputs against the per-length plans' (dB):", agreement)
    keys = ["setting", "what", "batch", "n", "first_ms", "steady_ms", "max_err_vs_fp32", "mean_err_vs_fp32", "note"]
    for row in table:
        for key in keys:
            row.setdefault(key, "")
    text = [
        f"\n## One cuDNN attention plan for every prompt length (`probe_shared_attention_plans.py`), "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}\n",
        f"Command: `{command_line('probe_shared_attention_plans.py', argv, folder='experiments')}`  ",
        f"Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
        f"bf16 attention at 4096 image tokens + n text tokens; `{ENV}` 0 (per-length plans) and 1 (shared plans), "
        "each in its own process. first_ms: the first call at that length (the lengths in this order); steady_ms: one "
        "call, back-to-back. The shared plans' outputs against the per-length plans' on the same inputs and weights, "
        f"SNR (dB): {agreement}\n",
        *markdown_table(table, keys),
    ]
    publish("\n".join(text) + "\n", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
