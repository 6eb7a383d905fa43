"""Denoise speed and per-GPU memory of multi-GPU Krea-2 (Ulysses, tensor parallelism) against one GPU, cache off/on.

Full size (12.8 B, random weights identical on every rank), bf16, 1024x1024 (4096 image tokens), Turbo 8 steps, text
padded to 512 with 48 real tokens (random tapped states; no text encoder, no VAE: latents out). Caching "on" forces
the default-settings pattern through the real decision path: W=4, MC=3 and a threshold no diff reaches, so steps 4-6
are cached by the (all-reduced) diff and step 7 computed: 5 of 8 computed. One launch measures, in order: one GPU
(rank 0 alone, the others wait), Ulysses over all ranks, TP over all ranks, and TP 2 x Ulysses 2 on 4 ranks. Per
run: median denoise time, speed-up over one GPU (same cache setting and uncached), peak allocated memory per GPU
during denoising, weights per GPU, the output against one GPU (bitwise? max |diff|, relative L2) and whether every
rank took the same cache decisions.

    # two GPUs (NVLink multicast stays off on shared hosts)
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/bench_parallel.py --results benchmarks/RESULTS.md
    # logic check on CPU with gloo, tiny model
    torchrun --nproc_per_node 2 benchmarks/bench_parallel.py --tiny --device cpu

Rank 0 prints the table and writes JSON to `--out` (default `$OUT/bench_parallel.json`, else `./bench_parallel.json`)
plus the same section `--results` appends as Markdown beside it (`bench_parallel.md`).
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
import time

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)  # before any NCCL communicator exists

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from publish import publish  # noqa: E402

import dicache  # noqa: E402
from dicache.models.krea2.pipeline import Krea2Pipeline  # noqa: E402
from dicache.models.krea2.scheduler import FlowMatchEulerScheduler  # noqa: E402
from dicache.models.krea2.tiny import small_transformer_config  # noqa: E402
from dicache.models.krea2.transformer import Krea2Transformer  # noqa: E402
from dicache.parallel import ParallelContext, build_context, init_parallel, parallelize  # noqa: E402

TINY_CONFIG = small_transformer_config(in_channels=64, num_attention_heads=8, num_key_value_heads=4)
SUFFIX_TOKENS = 5  # Krea's template ends with 5 real tokens after the padding
CACHE_OFF = {"enable_cache": False}
CACHE_ON = {  # the default settings' pattern on 8 steps (compute 0-3, cache 4-6 by diff, compute 7 by MC)
    "enable_cache": True,
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "max_warmup_steps": 4,
    "max_continuous_cached_steps": 3,
    "residual_diff_threshold": 1e9,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small model and image (logic check, e.g. on CPU with gloo)")
    p.add_argument("--device", default="cuda", help="cuda (NCCL, GPU LOCAL_RANK per process) or cpu (gloo)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on CUDA, else fp32")
    p.add_argument("--size", type=int, default=None, help="image side in pixels (default 1024; tiny: 128)")
    p.add_argument("--steps", type=int, default=8, help="Turbo steps (default 8)")
    p.add_argument("--text-len", type=int, default=None, help="padded text length (default 512; tiny: 32)")
    p.add_argument("--valid", type=int, default=None, help="real text tokens (default 48; tiny: 8)")
    p.add_argument("--warmup", type=int, default=1, help="untimed denoise runs per setting")
    p.add_argument("--iters", type=int, default=3, help="timed denoise runs per setting; the median is reported")
    p.add_argument(
        "--runs",
        default="single,ulysses,tp,tp2_ulysses2",
        help="which of single, ulysses, tp, tp2_ulysses2 to run (comma-separated; those the world size cannot hold "
        "are skipped)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/bench_parallel.json, else ./)")
    p.add_argument("--results", default=None, help="Markdown file rank 0 appends a results section to")
    args = p.parse_args(argv)
    args.size = args.size or (128 if args.tiny else 1024)
    args.text_len = args.text_len or (32 if args.tiny else 512)
    args.valid = args.valid or (8 if args.tiny else 48)
    if args.size % 16:
        p.error(f"--size must be a multiple of 16, got {args.size}")
    if not SUFFIX_TOKENS < args.valid <= args.text_len:
        p.error(f"--valid must be in ({SUFFIX_TOKENS}, --text-len], got {args.valid}")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# model and inputs: identical on every rank


def full_config(tiny: bool) -> dict:
    if tiny:
        return dict(TINY_CONFIG)
    import inspect

    params = inspect.signature(Krea2Transformer.__init__).parameters
    return {name: p.default for name, p in params.items() if name != "self"}


def build_model(config: dict, device: torch.device, dtype: torch.dtype, seed: int) -> Krea2Transformer:
    """Random full weights made on `device` from a seeded generator (the same tensors on every rank)."""
    with torch.device("meta"):
        model = Krea2Transformer(**config).to_dtype(dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "scale_shift_table" not in name:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=gen)  # unit-variance outputs
            else:  # biases, RMSNorm weights (scale 1 + w), modulation tables: small, so blocks are not identity
                param.normal_(0.0, 0.1, generator=gen)
    return model.eval().requires_grad_(False)


def make_inputs(args, config: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Text states `(1, T, L, D)` with `[prompt | padding | 5-token suffix]` valid, fp32 noise latents `(1, N, C)`."""
    gen = torch.Generator().manual_seed(args.seed + 1)  # CPU generator: the same numbers on every rank and device
    mask = torch.zeros(1, args.text_len, dtype=torch.bool)
    mask[:, : args.valid - SUFFIX_TOKENS] = True
    mask[:, -SUFFIX_TOKENS:] = True
    text = torch.randn(1, args.text_len, config["num_text_layers"], config["text_hidden_dim"], generator=gen)
    grid = args.size // 16
    latents = torch.randn(1, grid * grid, config["in_channels"], generator=gen)
    return dict(text=text.to(device, dtype), mask=mask.to(device), latents=latents.to(device), grid=grid)


# ---------------------------------------------------------------------------------------------------------------------
# measurement


class Device:
    """Synchronisation and memory counters that are no-ops on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated_gib(self) -> float | None:
        return torch.cuda.memory_allocated(self.device) / 2**30 if self.cuda else None

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None


def time_denoise(args, pipe, text, inputs: dict, sigmas, overrides: dict, dev: Device, barrier) -> dict:
    """Warm up, then time `args.iters` denoising runs under `overrides`; peak memory of the timed runs."""
    grid = inputs["grid"]

    def denoise() -> torch.Tensor:
        with dicache.request(pipe, config=overrides):
            return pipe.denoise(text, None, inputs["latents"], grid, grid, sigmas, 1.0)

    for _ in range(args.warmup):
        denoise()
    dev.sync()
    dev.reset_peak()
    times = []
    for _ in range(args.iters):
        barrier()
        dev.sync()
        start = time.perf_counter()
        latents = denoise()
        dev.sync()
        times.append(time.perf_counter() - start)
    stats = dicache.stats(pipe)
    return {
        "denoise_s": statistics.median(times),
        "times_s": times,
        "peak_gib": dev.peak_gib(),
        "cached_steps": {name: sorted(b.cached_steps) for name, b in stats.branches.items()},
        "diffs": {name: dict(b.diffs) for name, b in stats.branches.items()},
        "compute_fraction": stats.compute_fraction,
        "latents": latents.float().cpu(),
    }


def measure_run(
    args, label: str, ctx: ParallelContext, config: dict, inputs: dict, dtype: torch.dtype, dev: Device, control
) -> dict:
    """Build, split and time one configuration on the ranks of `ctx` (a single-process context: this rank alone)."""
    model = build_model(config, dev.device, dtype, args.seed)
    parallelize(model, ctx)
    dev.free()
    out: dict = {"run": label, "gpus": ctx.world_size, "tp": ctx.tp_size, "ulysses": ctx.sp_size}
    out["weights_gib"] = dev.allocated_gib()
    pipe = Krea2Pipeline(model, FlowMatchEulerScheduler(), is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    dicache.enable(pipe, {"enable_cache": True})
    sigmas = pipe.sigmas(args.steps, inputs["grid"] ** 2, "turbo")

    def barrier() -> None:
        if ctx.enabled:
            dist.barrier(group=control)

    with torch.inference_mode():
        text = pipe.text_conditioning(inputs["text"], inputs["mask"], 1)
        for mode, overrides in (("off", CACHE_OFF), ("on", CACHE_ON)):
            out[mode] = time_denoise(args, pipe, text, inputs, sigmas, overrides, dev, barrier)
    dicache.disable(pipe)
    return out


def gather(control, value):
    """Every rank's `value` (a list indexed by rank) over the CPU control group."""
    if control is None:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=control)
    return values


def row_subset_checks(config: dict, text: int, image: int, degree: int, device: torch.device, dtype) -> dict:
    """Does each kernel Ulysses relies on give the same bits on a share as on the whole? (explains the SP column)

    Linear layers: rows `[text, image / degree]` alone vs within all `text + image` rows. Attention: the first
    `1 / degree` of the heads alone vs within all heads, over the full sequence.
    """
    from dicache.models.krea2.attention import gqa_attention

    gen = torch.Generator(device=device).manual_seed(123)
    width, hidden, head_dim = (
        config["attention_head_dim"] * config["num_attention_heads"],
        config["intermediate_size"],
        config["attention_head_dim"],
    )
    kv_width = config["num_key_value_heads"] * head_dim
    rows = text + image // degree
    checks = {}
    for name, k, n in (
        ("to_q / to_gate / to_out", width, width),
        ("to_k / to_v", width, kv_width),
        ("ff gate / up", width, hidden),
        ("ff down", hidden, width),
    ):
        x = torch.randn(text + image, k, generator=gen, device=device).to(dtype)
        w = torch.randn(n, k, generator=gen, device=device).to(dtype) * k**-0.5
        whole = torch.nn.functional.linear(x, w)[:rows]
        share = torch.nn.functional.linear(x[:rows].clone(), w)
        checks[f"linear {name} ({k}->{n}), {rows} of {text + image} rows"] = bool(torch.equal(whole, share))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    q = torch.randn(1, heads, text + image, head_dim, generator=gen, device=device).to(dtype)
    kv = torch.randn(2, 1, kv_heads, text + image, head_dim, generator=gen, device=device).to(dtype)
    whole = gqa_attention(q, kv[0], kv[1])[:, : heads // degree]
    share = gqa_attention(
        q[:, : heads // degree].clone(), kv[0][:, : kv_heads // degree].clone(), kv[1][:, : kv_heads // degree].clone()
    )
    checks[f"attention {heads // degree} of {heads} heads"] = bool(torch.equal(whole, share))
    return checks


def compare(latents: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = (latents - reference).abs()
    return {
        "bitwise": bool(torch.equal(latents, reference)),
        "max_abs_diff": float(diff.max()),
        "rel_l2": float((latents - reference).norm() / reference.norm()),
    }


def run(args: argparse.Namespace) -> dict | None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    base = init_parallel(1, world, device=args.device)  # joins the group; every run builds its own split below
    dev = Device(base.device)
    if dev.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dtype_name = args.dtype or ("bf16" if dev.cuda else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    config = full_config(args.tiny)
    inputs = make_inputs(args, config, dev.device, dtype)
    control = dist.new_group(backend="gloo") if world > 1 else None  # CPU side: waits and object gathers
    rank = base.rank

    layouts = {"single": (1, 1), "ulysses": (1, world), "tp": (world, 1), "tp2_ulysses2": (2, 2)}
    wanted = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(wanted) - set(layouts))
    if unknown:
        raise SystemExit(f"--runs: unknown run(s) {', '.join(unknown)}; choose from {', '.join(layouts)}")
    checks = {}
    if rank == 0 and world > 1:
        with torch.inference_mode():
            checks = row_subset_checks(config, args.valid, inputs["grid"] ** 2, world, dev.device, dtype)
    results, reference, skipped = [], None, []
    for name in wanted:
        tp, sp = layouts[name]
        if name != "single" and (tp * sp != world or world == 1):
            skipped.append(f"{name} (needs {tp * sp} processes, launched {world})")
            continue
        label = {"single": "1 GPU", "ulysses": f"Ulysses {sp}", "tp": f"TP {tp}", "tp2_ulysses2": "TP 2 x Ulysses 2"}
        if name == "single":
            record = None
            if rank == 0:
                single = ParallelContext(device=dev.device)
                record = measure_run(args, label[name], single, config, inputs, dtype, dev, control)
            if control is not None:  # the other ranks wait on the CPU group while rank 0 runs alone
                dist.barrier(group=control)
        else:
            ctx = build_context(tp, sp, dev.device)
            record = measure_run(args, label[name], ctx, config, inputs, dtype, dev, control)
        per_rank = gather(control, record)
        dev.free()
        if rank != 0:
            continue
        record = per_rank[0]
        summary = {k: v for k, v in record.items() if k not in ("off", "on")}
        summary["weights_gib_per_gpu"] = [r["weights_gib"] for r in per_rank if r is not None]
        for mode in ("off", "on"):
            ranks = [r[mode] for r in per_rank if r is not None]
            entry = {
                "denoise_s": max(r["denoise_s"] for r in ranks),
                "times_s": record[mode]["times_s"],
                "peak_gib_per_gpu": [r["peak_gib"] for r in ranks],
                "cached_steps": record[mode]["cached_steps"],
                "diffs": record[mode]["diffs"],
                "compute_fraction": record[mode]["compute_fraction"],
                "decisions_agree": all(
                    (r["cached_steps"], r["diffs"]) == (ranks[0]["cached_steps"], ranks[0]["diffs"]) for r in ranks
                ),
                "outputs_agree": all(torch.equal(r["latents"], ranks[0]["latents"]) for r in ranks),
            }
            if reference is not None:
                entry["vs_1_gpu"] = compare(record[mode]["latents"], reference[mode]["latents"])
                entry["speedup_same_cache"] = reference[mode]["denoise_s"] / entry["denoise_s"]
                entry["speedup_vs_uncached"] = reference["off"]["denoise_s"] / entry["denoise_s"]
            summary[mode] = entry
        if name == "single":
            reference = record
        results.append(summary)
        off, on = summary["off"]["denoise_s"], summary["on"]["denoise_s"]
        print(f"[rank 0] {summary['run']}: cache off {off:.3f} s, on {on:.3f} s", flush=True)
    if control is not None:
        dist.barrier(group=control)
    base.shutdown()
    if rank != 0:
        return None
    return {
        "command": " ".join(["torchrun" if world > 1 else os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(dev.device, world),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "results")},
            "dtype": dtype_name,
            "world_size": world,
            "image_tokens": inputs["grid"] ** 2,
            "parameters": sum(p.numel() for p in build_meta(config).parameters()),
            "cache_on": CACHE_ON,
        },
        "skipped": skipped,
        "row_subset_checks": checks,
        "results": results,
    }


def build_meta(config: dict) -> Krea2Transformer:
    with torch.device("meta"):
        return Krea2Transformer(**config)


def machine(device: torch.device, world: int) -> str:
    if device.type == "cuda":
        return f"{world} x {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}, NCCL)"
    return f"{platform.processor() or platform.machine()} CPU, {world} process(es) x {torch.get_num_threads()} threads"


# ---------------------------------------------------------------------------------------------------------------------
# reporting


def _fmt(value, spec: str = ".3f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def table(report: dict) -> str:
    lines = [
        "| run | cache | compute | denoise s | speed-up vs 1 GPU (same cache) | vs 1 GPU uncached | peak GiB/GPU "
        "| weights GiB/GPU | output vs 1 GPU | decisions agree |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        for mode in ("off", "on"):
            e = r[mode]
            peak = max((p for p in e["peak_gib_per_gpu"] if p is not None), default=None)
            weights = max((w for w in r["weights_gib_per_gpu"] if w is not None), default=None)
            vs = e.get("vs_1_gpu")
            if vs is None:
                output = "reference"
            elif vs["bitwise"]:
                output = "bitwise equal"
            else:
                output = f"max {vs['max_abs_diff']:.2e}, rel L2 {vs['rel_l2']:.2e}"
            lines.append(
                f"| {r['run']} | {mode} | {e['compute_fraction']:.3f} | {e['denoise_s']:.3f} "
                f"| {_fmt(e.get('speedup_same_cache'), '.2f', '×')} | {_fmt(e.get('speedup_vs_uncached'), '.2f', '×')} "
                f"| {_fmt(peak, '.1f')} | {_fmt(weights, '.1f')} | {output} "
                f"| {'yes' if e['decisions_agree'] and e['outputs_agree'] else '**no**'} |"
            )
    return "\n".join(lines)


def markdown(report: dict) -> str:
    s = report["settings"]
    head = (
        f"## Multi-GPU Krea-2: Ulysses and tensor parallelism ({report['date'][:10]})\n\n"
        f"`{report['command']}` on {report['machine']}, torch {report['versions']['torch']}. "
        f"{_count(s['parameters'])} parameters (random, identical on every rank), {s['dtype']}, "
        f"{s['size']}x{s['size']} ({s['image_tokens']} image tokens), Turbo {s['steps']} steps, text {s['text_len']} "
        f"padded / {s['valid']} real. Denoise only (text conditioning computed once before timing), median of "
        f"{s['iters']} after {s['warmup']} warm-up; a run's time is its slowest rank's. Cache on = default pattern "
        f"forced through the dynamic path (W 4, MC 3, threshold above every diff: 5 of 8 steps computed, the diff "
        f"all-reduced over the model-parallel group). Peak = most memory allocated on one GPU while denoising; "
        f"weights = allocated after building and splitting.\n\n"
    )
    tail = f"\n\nSkipped: {', '.join(report['skipped'])}." if report["skipped"] else ""
    if report["row_subset_checks"]:
        listed = "; ".join(
            f"{k}: {'same bits' if v else '**differs**'}" for k, v in report["row_subset_checks"].items()
        )
        tail += f"\n\nKernels on a Ulysses share vs on the whole (bitwise): {listed}."
    return head + table(report) + tail + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    if report is None:
        return
    print(table(report))
    for check, same in report["row_subset_checks"].items():
        print(f"share vs whole, {check}: {'same bits' if same else 'DIFFERENT bits'}")
    out = pathlib.Path(args.out) if args.out else pathlib.Path(os.environ.get("OUT", ".")) / "bench_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))  # the RESULTS.md section, also when run on another machine
    print(f"wrote {out} and {out.with_suffix('.md')}")
    publish(markdown(report), args.results)


if __name__ == "__main__":
    main()
