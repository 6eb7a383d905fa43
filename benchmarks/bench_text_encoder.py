"""The text encoder's precision options (`--text-encoder-quantization`, issue 27): for each method, one prompt's
encode time (the server's `encode` phase less the starting noise) eagerly and replayed from CUDA graphs (what
`pipe.compile()` / `--compile` turn on, on a GPU), the encoder's weight bytes, the encode's activation peak, the graph's
memory pool, and the error of its output (Krea-2's 12 tapped hidden states) against the same weights in the model dtype.

Full-size Qwen3-VL-4B (as Krea-2 uses it: the language model, 36 layers; random weights from its config alone,
`--load-format dummy`) on a GPU for speed and memory, or the embedded checkpoint's trained tiny encoder (`--tiny`, any
device) for fidelity:

    python benchmarks/bench_text_encoder.py [--results benchmarks/RESULTS.md]            # GPU
    python benchmarks/bench_text_encoder.py --tiny --device cpu --methods none,fp8         # logic check

Prints a table, appends it to --results, writes $OUT/bench_text_encoder.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_serving import EMBEDDED_CHECKPOINT, write_model_folder  # noqa: E402
from publish import command_line, publish  # noqa: E402

from dicache.models.krea2.text import Krea2TextEncoder  # noqa: E402
from dicache.quantization import TEXT_ENCODER_QUANTIZATION_METHODS, quantize_text_encoder  # noqa: E402
from dicache.server.memory import module_bytes  # noqa: E402

PROMPT = "a red apple on a wooden table, soft morning light, shallow depth of field, a cat asleep in the background"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none," + ",".join(TEXT_ENCODER_QUANTIZATION_METHODS))
    p.add_argument("--reps", type=int, default=20, help="timed encodes per method (after 3 warm-up ones)")
    p.add_argument("--tiny", action="store_true", help="the embedded checkpoint's trained encoder (fidelity)")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--profile", action="store_true", help="also the top kernels of one eager encode per method (torch.profiler)"
    )
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = set(args.methods) - {"none", *TEXT_ENCODER_QUANTIZATION_METHODS}
    if unknown:
        p.error(f"--methods: unknown {sorted(unknown)}; allowed: none, {', '.join(TEXT_ENCODER_QUANTIZATION_METHODS)}")
    return args


def measure(folder: pathlib.Path, method: str, args, reference: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    """One method on a freshly loaded encoder (same seed, so the same random weights): its row and its output."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    load_format = "auto" if args.tiny else "dummy"
    encoder = Krea2TextEncoder.from_pretrained(folder, device=device, load_format=load_format)
    if method != "none":
        quantize_text_encoder(encoder.text_encoder, method)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def timed(encode, prefix: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """`args.reps` timed calls of `encode`: the last output and `{prefix}_ms` (median), `{prefix}_ms_min`."""
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            hidden, mask = encode(PROMPT)
            sync()
            times.append(time.perf_counter() - t0)
        ms = {f"{prefix}_ms": round(1e3 * statistics.median(times), 2), f"{prefix}_ms_min": round(1e3 * min(times), 2)}
        return hidden, mask, ms

    with torch.inference_mode():
        for _ in range(3):
            encoder.encode(PROMPT)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if cuda else 0
        hidden, mask, times = timed(encoder.encode, "encode")
        peak = (torch.cuda.max_memory_allocated(device) - base) if cuda else 0
        profile = kernel_profile(encoder, cuda) if args.profile else None
        if cuda:  # the same encoder replayed from CUDA graphs: its values must be the eager ones
            eager = hidden.clone()
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(device)
            encoder.compile()  # as --compile does: CUDA graphs, FP8-stored linears compiled
            for _ in range(3):
                encoder.encode(PROMPT)
            sync()
            times["graph_pool_gb"] = round((torch.cuda.memory_reserved(device) - reserved) / 1e9, 3)
            hidden, mask, replayed = timed(encoder.encode, "graphs")
            times.update(replayed, graphs_same_bits=bool(torch.equal(hidden, eager)))
    out = hidden[mask].float().cpu()
    row = {
        "method": method,
        **times,
        "weights_gb": round(module_bytes(encoder.text_encoder, encoder.device) / 1e9, 3),
        "activation_peak_gb": round(peak / 1e9, 3),
        "tokens": int(mask.sum()),
    }
    if profile is not None:
        row["profile"] = profile
    if reference is not None:
        err = (out - reference).norm() / reference.norm()
        row["rel_error"] = float(f"{float(err):.3g}")
        row["snr_db"] = round(float(-20 * torch.log10(err)), 2) if err > 0 else float("inf")
    del encoder, hidden, mask
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row, out


def kernel_profile(encoder: Krea2TextEncoder, cuda: bool) -> str:
    """The top kernels (or CPU ops) of one eager encode, by total time: where the time of a method goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        encoder.encode(PROMPT)
        if cuda:
            torch.cuda.synchronize()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=70)


def main(argv=None) -> int:
    args = parse_args(argv)
    folder = EMBEDDED_CHECKPOINT if args.tiny else write_model_folder(pathlib.Path(tempfile.mkdtemp()) / "krea2", False)
    rows, reference = [], None
    for method in args.methods:
        row, out = measure(folder, method, args, reference)
        if method == "none":
            reference = out
        rows.append(row)
        print(row, flush=True)
    device = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"{platform.machine()} CPU ({os.cpu_count()} cores)"
    )
    size = (
        "the embedded checkpoint's trained tiny encoder"
        if args.tiny
        else "full-size Qwen3-VL-4B language model, random weights (`--load-format dummy`)"
    )
    text = [
        f"\n## Text encoder precision (`bench_text_encoder.py`), {datetime.datetime.now():%Y-%m-%d %H:%M}\n",
        f"Command: `{command_line('bench_text_encoder.py', argv)}`  ",
        f"Machine: {device}, torch {torch.__version__}; {size}, one prompt padded to the encoder's sequence length, "
        "eager and (on a GPU) as `--compile` runs it (`Krea2TextEncoder.compile`: replayed from CUDA graphs, "
        "FP8-stored linears compiled; same bits: the replay's output equals the eager one); SNR of the tapped hidden "
        "states (real tokens) against `none`\n",
        "| --text-encoder-quantization | encode (median, ms) | min (ms) | CUDA graphs (median, ms) | min (ms) "
        "| same bits | graph pool (GB) | weights (GB) | activation peak (GB) | SNR (dB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        text.append(
            f"| {r['method']} | {r['encode_ms']} | {r['encode_ms_min']} | {r.get('graphs_ms', '')} | "
            f"{r.get('graphs_ms_min', '')} | {r.get('graphs_same_bits', '')} | {r.get('graph_pool_gb', '')} | "
            f"{r['weights_gb']} | {r['activation_peak_gb']} | {r.get('snr_db', '')} |"
        )
    for r in rows:
        if "profile" in r:
            text += ["", f"Top kernels of one eager encode, {r['method']}:", "", "```", r["profile"], "```"]
    publish("\n".join(text) + "\n", args.results)
    out_dir = pathlib.Path(os.environ.get("OUT", "."))
    (out_dir / "bench_text_encoder.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
