"""Probe: where does the compiled full-size Krea-2 forward spend time beyond its kernels, and what removes it?

Native model, random weights at the real size, bf16, 1024² (4096 image tokens) + 48 real text tokens, blocks compiled.
Measures, each side by side in one run:

- forward: median of synchronised single forwards, the per-forward time of back-to-back forwards (one sync at the
  end), the SM clock / power draw / power limit read right after them, and single forwards after 3 s of idling;
- graph: the same forward captured once as a CUDA graph and replayed (static inputs), and its output difference;
- qk: the attention input preparation (q/k RMSNorm + RoPE + head-major layout) as written in the model against a
  rewrite with the rotation as `x * cos + swap_pairs(x) * sin`, both compiled, each followed by SDPA (the model's
  `apply_rope` takes the rewrite's form since 2026-12-03, so both now time that rotation);
- attention: SDPA backends on the block's shapes (cuDNN / flash with GQA, cuDNN with K/V repeated);
- gemm: TFLOP/s of the block's GEMM shapes over the joint rows (4144), split into image + text GEMMs, image rows only,
  and M = 4224 / 8288 (8288 = cond + uncond packed);
- autotune: the forward with the blocks recompiled in inductor's default and max-autotune (no CUDA graphs) modes.

    python experiments/probe_forward_time.py [--tiny --device cpu]

Prints one JSON document and writes it to $OUT/probe_forward_time.json.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))  # publish, bench_*
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_krea2_forward import TINY_CONFIG, build_models, gpu_clock  # noqa: E402
from publish import command_line, publish  # noqa: E402

from dicache.models.krea2 import Krea2Pipeline  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def time_synced(fn, device: torch.device, reps: int) -> float:
    """Median wall seconds of `fn`, synchronising before and after each call."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return median(times)


def time_back_to_back(fn, device: torch.device, reps: int) -> float:
    """Wall seconds per call of `reps` calls issued back to back, one synchronisation at the end."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


def time_after_idle(fn, device: torch.device, reps: int = 3, idle_s: float = 3.0) -> float:
    """Median wall seconds of single calls each made after `idle_s` of idling (clocks back up, power budget unused)."""
    times = []
    for _ in range(reps):
        sync(device)
        time.sleep(idle_s)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return median(times)


def swap_pairs_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same rotation as `apply_rope`, written as `x * cos2 + swap(x) * sin2` on the interleaved layout."""
    xf = x.float()
    cos2 = cos.repeat_interleave(2, dim=-1)[:, None, :]
    sign = torch.tensor([-1.0, 1.0], device=x.device).repeat(cos.shape[-1])
    sin2 = sin.repeat_interleave(2, dim=-1)[:, None, :] * sign
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos2 + swapped * sin2).to(x.dtype)


def manual_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def probe_qk(attn, seq: int, device, dtype, reps: int, compile_: bool) -> dict:
    from dicache.models.krea2.transformer import apply_rope

    hd, hq, hk = attn.head_dim, attn.num_heads, attn.num_kv_heads
    g = torch.Generator(device=device).manual_seed(3)
    ql = torch.randn(1, seq, hq * hd, generator=g, device=device).to(dtype)
    kl = torch.randn(1, seq, hk * hd, generator=g, device=device).to(dtype)
    vl = torch.randn(1, seq, hk * hd, generator=g, device=device).to(dtype)
    ang = torch.rand(seq, hd // 2, generator=g, device=device) * 6.28
    cos, sin = ang.cos(), ang.sin()
    eps = attn.norm_q.eps

    def current(ql, kl, vl, cos, sin):
        q = attn.norm_q(ql.unflatten(-1, (hq, hd)))
        k = attn.norm_k(kl.unflatten(-1, (hk, hd)))
        v = vl.unflatten(-1, (hk, hd))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)

    def rewrite(ql, kl, vl, cos, sin):
        q = manual_rms(ql.unflatten(-1, (hq, hd)), attn.norm_q.weight, eps)
        k = manual_rms(kl.unflatten(-1, (hk, hd)), attn.norm_k.weight, eps)
        v = vl.unflatten(-1, (hk, hd))
        q, k = swap_pairs_rope(q, cos, sin), swap_pairs_rope(k, cos, sin)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)

    q0 = torch.randn(1, hq, seq, hd, generator=g, device=device).to(dtype)
    k0 = torch.randn(1, hk, seq, hd, generator=g, device=device).to(dtype)

    def sdpa_only():
        return F.scaled_dot_product_attention(q0, k0, k0, enable_gqa=True)

    out = {}
    ref = current(ql, kl, vl, cos, sin)
    for name, fn in (("current", current), ("rewrite", rewrite)):
        run = torch.compile(fn, fullgraph=True) if compile_ else fn
        with torch.no_grad():
            got = run(ql, kl, vl, cos, sin)
            out[f"{name}_max_abs_diff"] = float((got.float() - ref.float()).abs().max())
            out[f"{name}_s"] = time_back_to_back(lambda r=run: r(ql, kl, vl, cos, sin), device, reps)
    out["sdpa_only_s"] = time_back_to_back(sdpa_only, device, reps)
    return out


def probe_attention(seq: int, hq: int, hk: int, hd: int, device, dtype, reps: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device=device).manual_seed(4)
    q = torch.randn(1, hq, seq, hd, generator=g, device=device).to(dtype)
    k = torch.randn(1, hk, seq, hd, generator=g, device=device).to(dtype)
    v = torch.randn(1, hk, seq, hd, generator=g, device=device).to(dtype)
    flops = 4 * seq * seq * hd * hq
    out = {}
    cases = {
        "cudnn_gqa": (SDPBackend.CUDNN_ATTENTION, lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        "flash_gqa": (SDPBackend.FLASH_ATTENTION, lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        "cudnn_repeat": (
            SDPBackend.CUDNN_ATTENTION,
            lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
            ),
        ),
    }
    for name, (backend, fn) in cases.items():
        try:
            with sdpa_kernel([backend]), torch.no_grad():
                s = time_back_to_back(fn, device, reps)
            out[name] = {"ms": round(s * 1e3, 3), "tflops": round(flops / s / 1e12, 1)}
        except RuntimeError as err:
            out[name] = {"error": str(err).splitlines()[0][:100]}
    return out


def probe_gemm(width: int, ffn: int, kv: int, text: int, device, dtype, reps: int) -> dict:
    """TFLOP/s of each block GEMM over 4096 image rows + `text` text rows: one GEMM over all rows, the same rows as
    two GEMMs (image rows, text rows), the image rows alone; and M = 4224 / 8288 (padded / cond + uncond packed).
    The variants of one shape are timed in interleaved rounds so that power and clock state affect them alike."""
    out = {}
    shapes = {"q_gate_out": (width, width), "kv": (width, kv), "ffn_up": (width, ffn), "ffn_down": (ffn, width)}
    for name, (k_dim, n_dim) in shapes.items():
        cases = gemm_cases(k_dim, n_dim, text, device, dtype)
        times: dict[str, list[float]] = {case: [] for case in cases}
        for _ in range(3):
            for case, (_, fn) in cases.items():
                times[case].append(time_back_to_back(fn, device, reps))
        out[name] = {
            case: round(2 * m * k_dim * n_dim / median(times[case]) / 1e12, 1) for case, (m, _) in cases.items()
        }
    return out


def gemm_cases(k_dim: int, n_dim: int, text: int, device, dtype, image: int = 4096) -> dict:
    """name -> (rows M, callable) for one weight `(n_dim, k_dim)`."""
    w = torch.randn(n_dim, k_dim, device=device, dtype=dtype) * k_dim**-0.5
    a = torch.randn(image + text, k_dim, device=device, dtype=dtype)
    a_img, a_txt = a[:image], a[image:]
    big = {m: torch.randn(m, k_dim, device=device, dtype=dtype) for m in (4224, 8288)}
    return {
        "joint": (image + text, lambda: F.linear(a, w)),
        "split": (image + text, lambda: (F.linear(a_img, w), F.linear(a_txt, w))),
        "image_only": (image, lambda: F.linear(a_img, w)),
        "m4224": (4224, lambda: F.linear(big[4224], w)),
        "m8288": (8288, lambda: F.linear(big[8288], w)),
    }


def time_forward_compiled(ours, forward, device, reps: int, mode: str) -> dict:
    """Recompile the blocks with `mode` and time the forward (compile + warm-up seconds reported)."""
    import torch._dynamo

    torch._dynamo.reset()
    start = time.perf_counter()
    for block in ours.transformer_blocks:
        block._compiled_call_impl = None
        block.compile(fullgraph=True, mode=mode)
    forward()
    sync(device)
    row = {"compile_warmup_s": round(time.perf_counter() - start, 1)}
    row["synced_s"] = round(time_synced(forward, device, reps), 5)
    row["back_to_back_s"] = round(time_back_to_back(forward, device, reps), 5)
    row.update(gpu_clock())
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--results", default=None, help="append the tables to this markdown file")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: graph,qk,attention,gemm,autotune")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from dicache.models.krea2 import Krea2Transformer

    if args.tiny:
        config = dict(TINY_CONFIG)
    else:  # the released configuration = the constructor's defaults
        params = inspect.signature(Krea2Transformer.__init__).parameters
        config = {k: p.default for k, p in params.items() if k != "self"}
    size, text_len, valid = (128, 32, 8) if args.tiny else (1024, 512, 48)
    ours, _, _ = build_models(config, device, dtype, 0, False)
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    report["torch"] = torch.__version__
    report["setup"] = (
        f"{str(dtype).removeprefix('torch.')}, {size}², {valid} real text tokens, "
        f"blocks {'eager' if args.no_compile else 'compiled'}"
    )
    gen = torch.Generator(device=device).manual_seed(1)
    pe = torch.randn(1, text_len, config["num_text_layers"], config["text_hidden_dim"], generator=gen, device=device)
    mask = torch.zeros(1, text_len, dtype=torch.bool, device=device)
    mask[:, :valid] = True
    image_tokens = (size // 16) ** 2
    with torch.no_grad():
        text = ours.encode_text(pe.to(dtype), mask)
    x = torch.randn(1, image_tokens, config["in_channels"], generator=gen, device=device).to(dtype)
    ids = Krea2Pipeline.position_ids(size // 16, size // 16, device)
    t = torch.full((1,), 0.7, device=device)
    if not args.no_compile:
        start = time.perf_counter()
        for block in ours.transformer_blocks:
            block.compile(fullgraph=True)
        with torch.no_grad():
            ours(x, text, t, ids)
        sync(device)
        report["compile_warmup_s"] = round(time.perf_counter() - start, 1)

    def forward():
        with torch.no_grad():
            return ours(x, text, t, ids)

    fwd = {
        "synced_s": time_synced(forward, device, args.reps),
        "back_to_back_s": time_back_to_back(forward, device, args.reps),
    }
    fwd.update(gpu_clock())  # read right after the back-to-back forwards: the sustained state
    fwd["after_idle_s"] = time_after_idle(forward, device)
    fwd = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in fwd.items()}
    report["forward"] = fwd
    print(json.dumps(report), flush=True)

    if "graph" not in skip and device.type == "cuda":
        eager_out = forward()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = forward()

        def replay():
            graph.replay()
            return static_out

        replay()
        sync(device)
        report["graph"] = {
            "synced_s": round(time_synced(replay, device, args.reps), 5),
            "back_to_back_s": round(time_back_to_back(replay, device, args.reps), 5),
            "max_abs_diff_vs_eager": float((static_out.float() - eager_out.float()).abs().max()),
            "memory_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
        }
        del graph, static_out
        print(json.dumps(report["graph"]), flush=True)

    attn = ours.transformer_blocks[0].attn
    seq = image_tokens + valid
    if "qk" not in skip:
        report["qk"] = probe_qk(attn, seq, device, dtype, args.reps * 3, not args.no_compile)
        print(json.dumps(report["qk"]), flush=True)
    if "attention" not in skip and device.type == "cuda":
        report["attention"] = probe_attention(
            seq, attn.num_heads, attn.num_kv_heads, attn.head_dim, device, dtype, args.reps * 3
        )
        print(json.dumps(report["attention"]), flush=True)
    if "gemm" not in skip and device.type == "cuda":
        width = config["attention_head_dim"] * config["num_attention_heads"]
        kv = config["attention_head_dim"] * config["num_key_value_heads"]
        report["gemm"] = probe_gemm(width, config["intermediate_size"], kv, valid, device, dtype, args.reps * 2)
        print(json.dumps(report["gemm"]), flush=True)
    if "autotune" not in skip and device.type == "cuda" and not args.no_compile:
        report["autotune"] = {
            "default": time_forward_compiled(ours, forward, device, args.reps, "default"),
            "max-autotune-no-cudagraphs": time_forward_compiled(
                ours, forward, device, args.reps, "max-autotune-no-cudagraphs"
            ),
        }
        print(json.dumps(report["autotune"]), flush=True)
    out = pathlib.Path(os.environ.get("OUT", ".")) / "probe_forward_time.json"
    out.write_text(json.dumps(report, indent=1))
    publish(markdown(report, command_line("probe_forward_time.py", argv, folder="experiments")), args.results)


def markdown(report: dict, command: str) -> str:
    """The report as a RESULTS.md section: one table per part."""
    lines = [
        f"\n## Krea-2 forward: where the time goes ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)\n",
        f"Command: `{command}`  ",
        f"Machine: {report['device']}, torch {report['torch']}, {report['setup']}, random weights\n",
    ]
    for part in ("forward", "graph", "qk", "attention", "gemm", "autotune"):
        if part not in report:
            continue
        data = report[part]
        rows = data if all(isinstance(v, dict) for v in data.values()) else {part: data}
        keys = list(dict.fromkeys(k for row in rows.values() for k in row))
        lines += [f"### {part}\n", "| | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        lines += [f"| {name} | " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for name, row in rows.items()]
        lines.append("")
    return "\n".join(lines)


def _cell(value) -> str:
    return f"{value:.5g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
