"""Per-forward speed of the native Krea-2 transformer beside diffusers' `Krea2Transformer2DModel`.

Default: the full-size model (12.8 B, random weights shared by both implementations), bf16, 1024x1024 (4096 image
tokens, 64 channels), text padded to 512 with 48 real tokens laid out as Krea's template (`[prompt | PAD | suffix]`).
Reports per variant: median time (CUDA events), the FLOP floor at a stated peak and the achieved TFLOP/s, speed-up over
diffusers eager, relative error against diffusers eager, peak memory; plus one block and the text path alone.

    python benchmarks/bench_krea2_forward.py                                  # H200, full size
    python benchmarks/bench_krea2_forward.py --results benchmarks/RESULTS.md  # also append a section there
    python benchmarks/bench_krea2_forward.py --tiny --device cpu              # logic check on a small model

FLOP count (multiply-add = 2 FLOPs): linear layers `2 * weights * tokens` over the tokens each layer actually sees,
attention `4 * N^2 * width` per block; elementwise work is not counted. The floor is FLOPs / `--peak-tflops`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from publish import publish  # noqa: E402

from dicache.models.krea2.tiny import small_transformer_config  # noqa: E402
from dicache.models.krea2.transformer import Krea2Transformer  # noqa: E402

TINY_CONFIG = small_transformer_config()
SUFFIX_TOKENS = 5  # Krea's template ends with `<|im_end|>\n<|im_start|>assistant\n`, always real


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small model and sequence (logic check, e.g. on CPU)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on CUDA, else fp32")
    p.add_argument("--height", type=int, default=None, help="pixels (default 1024; tiny: 128)")
    p.add_argument("--width", type=int, default=None, help="pixels (default 1024; tiny: 128)")
    p.add_argument("--text-len", type=int, default=None, help="padded text length (default 512; tiny: 32)")
    p.add_argument("--valid", type=int, default=None, help="real text tokens incl. the 5-token suffix (default 48)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="timed runs per variant; the median is reported")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="measured dense bf16 peak for the FLOP floor")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled-blocks variants")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode for the blocks (default: None)")
    p.add_argument("--no-diffusers", action="store_true", help="skip the diffusers column")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/bench_krea2_forward.json, else ./)")
    p.add_argument("--results", default=None, help="Markdown file to append a results section to")
    args = p.parse_args(argv)
    size = 128 if args.tiny else 1024
    args.height = args.height or size
    args.width = args.width or size
    args.text_len = args.text_len or (32 if args.tiny else 512)
    args.valid = args.valid or (8 if args.tiny else 48)
    if not SUFFIX_TOKENS < args.valid <= args.text_len:
        p.error(f"--valid must be in ({SUFFIX_TOKENS}, --text-len], got {args.valid}")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# models and inputs


def build_models(config: dict, device: torch.device, dtype: torch.dtype, seed: int, with_diffusers: bool):
    """Ours with random weights made directly on `device`, and diffusers' model sharing the very same tensors."""
    with torch.device("meta"):
        ours = Krea2Transformer(**config).to_dtype(dtype)
    ours.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if param.ndim == 2 and "scale_shift_table" not in name:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=gen)  # unit-variance outputs
            else:  # biases, RMSNorm weights (scale 1 + w), modulation tables: small, so blocks are not identity
                param.normal_(0.0, 0.1, generator=gen)
    ours.eval().requires_grad_(False)

    reference, note = None, ""
    if with_diffusers:
        try:
            from diffusers import Krea2Transformer2DModel
        except ImportError as err:
            note = f"diffusers not importable ({err}); diffusers column skipped"
        else:
            with torch.device("meta"):
                reference = Krea2Transformer2DModel(**config)
            reference.load_state_dict(ours.state_dict(), strict=True, assign=True)  # shares storage: no 2nd copy
            reference.eval().requires_grad_(False)
    return ours, reference, note


def make_inputs(args, config: dict, device: torch.device, dtype: torch.dtype) -> dict:
    grid_h, grid_w = args.height // 16, args.width // 16  # VAE x8, then 2x2 patches
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    mask = torch.zeros(1, args.text_len, dtype=torch.bool, device=device)
    mask[:, : args.valid - SUFFIX_TOKENS] = True
    mask[:, -SUFFIX_TOKENS:] = True
    rows, cols = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    shape_text = (1, args.text_len, config["num_text_layers"], config["text_hidden_dim"])
    return dict(
        hidden_states=torch.randn(1, grid_h * grid_w, config["in_channels"], generator=gen, device=device).to(dtype),
        encoder_hidden_states=torch.randn(shape_text, generator=gen, device=device).to(dtype),
        timestep=torch.full((1,), 0.7, device=device, dtype=dtype),
        position_ids=torch.cat([torch.zeros(args.text_len, 3), image_ids]).to(device),
        encoder_attention_mask=mask,
    )


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs


def forward_flops(config: dict, image_tokens: int, text_tokens: int, *, with_text_path: bool) -> float:
    """FLOPs of one batch-1 forward whose joint sequence holds `text_tokens + image_tokens` tokens."""
    c = config
    width = c["attention_head_dim"] * c["num_attention_heads"]
    flops = c["num_layers"] * block_flops(config, text_tokens + image_tokens)
    flops += 2 * 2 * c["in_channels"] * width * image_tokens  # img_in, final linear
    flops += 2 * (c["timestep_embed_dim"] * width + width * width + 6 * width * width)  # time MLP + modulation
    if with_text_path:
        flops += text_path_flops(config, text_tokens)
    return float(flops)


def block_flops(config: dict, tokens: int) -> float:
    """One transformer block over `tokens` tokens: its linear layers plus `4 * N^2 * width` of attention."""
    c = config
    width = c["attention_head_dim"] * c["num_attention_heads"]
    kv_width = c["attention_head_dim"] * c["num_key_value_heads"]
    block_weights = 3 * width * width + 2 * width * kv_width + 3 * width * c["intermediate_size"]
    return float(2 * block_weights * tokens + 4 * tokens * tokens * width)


def text_path_flops(config: dict, text_tokens: int) -> float:
    """Text fusion (layerwise blocks over `num_text_layers` per token, refiner blocks over tokens) + `txt_in`."""
    c = config
    dim, layers = c["text_hidden_dim"], c["num_text_layers"]
    kv_width = dim // c["text_num_attention_heads"] * c["text_num_key_value_heads"]
    block_weights = 3 * dim * dim + 2 * dim * kv_width + 3 * dim * c["text_intermediate_size"]
    width = c["attention_head_dim"] * c["num_attention_heads"]
    t = text_tokens
    flops = c["num_layerwise_text_blocks"] * t * (2 * block_weights * layers + 4 * layers * layers * dim)
    flops += c["num_refiner_text_blocks"] * (2 * block_weights * t + 4 * t * t * dim)
    flops += 2 * layers * dim * t + 2 * (dim * width + width * width) * t  # projector, txt_in
    return float(flops)


# ---------------------------------------------------------------------------------------------------------------------
# timing


class Timer:
    """Median wall time of a callable: CUDA events on GPU, perf_counter elsewhere. Also the peak memory it reached."""

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object]) -> dict:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start_first = time.perf_counter()
        fn()
        self.sync()
        first_s = time.perf_counter() - start_first  # includes compilation for compiled variants
        for _ in range(self.warmup):
            fn()
        self.sync()
        times = []
        for _ in range(self.iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else float("nan")
        return {"seconds": statistics.median(times), "min_s": min(times), "first_call_s": first_s, "peak_gib": peak}


def gpu_clock() -> dict:
    """SM clock (MHz), power draw and enforced power limit (W) of GPU 0 right now, read through NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {
            "sm_clock_MHz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "power_W": round(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000, 1),
            "power_limit_W": round(pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000, 1),
        }
    except Exception as err:  # pynvml missing or not permitted
        return {"clock_error": str(err)[:80]}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------------------------------------------------------------
# the benchmark

# Each row's speed-up is measured against the diffusers eager row of its kind.
BASELINE_ROW = {
    "forward": "diffusers eager",
    "block": "one block, diffusers eager",
    "text": "text path, diffusers (padded, masked)",
    "attention": "attention, diffusers style: K/V repeated + key mask",
}


class Bench:
    """Collects rows: time, FLOPs, floor, achieved TFLOP/s, error against the diffusers eager output, peak memory."""

    def __init__(self, args: argparse.Namespace, config: dict, image_tokens: int, timer: Timer) -> None:
        self.args, self.config, self.image_tokens, self.timer = args, config, image_tokens, timer
        self.rows: list[dict] = []
        self.errors: dict[str, str] = {}
        self.first_outputs: dict[str, torch.Tensor] = {}  # "diffusers eager" / "ours eager": for the error column

    def measure(self, name: str, kind: str, text_tokens: int, fn: Callable[[], torch.Tensor], text_path=False) -> None:
        """`kind`: forward | block | text; `text_tokens`: text tokens it processes; `text_path`: a forward that also
        runs text fusion + txt_in (counted in its FLOPs)."""
        try:
            stats = self.timer(fn)
            out = fn()
        except Exception as err:  # report and go on: one failing variant must not hide the others
            self.errors[name] = f"{type(err).__name__}: {err}"
            print(f"[error] {name}: {self.errors[name]}", file=sys.stderr)
            return
        error = float("nan")
        if kind == "forward":
            flops = forward_flops(self.config, self.image_tokens, text_tokens, with_text_path=text_path)
            reference = self.first_outputs.get("diffusers eager", self.first_outputs.get("ours eager"))
            if reference is not None:
                error = rel_err(out, reference)
            self.first_outputs.setdefault(name.split(",")[0], out)
        elif kind == "block":
            flops = block_flops(self.config, text_tokens + self.image_tokens)
        elif kind == "attention":
            n, c = text_tokens + self.image_tokens, self.config
            flops = 4.0 * n * n * c["attention_head_dim"] * c["num_attention_heads"]
        else:
            flops = text_path_flops(self.config, text_tokens)
        baseline = next((r for r in self.rows if r["name"] == BASELINE_ROW[kind]), None)
        self.rows.append(
            {
                "name": name,
                "kind": kind,
                "tokens": text_tokens + (self.image_tokens if kind != "text" else 0),
                **stats,
                "flops": flops,
                "floor_s": flops / (self.args.peak_tflops * 1e12),
                "tflops": flops / stats["seconds"] / 1e12,
                "speedup": baseline["seconds"] / stats["seconds"] if baseline else float("nan"),
                "rel_err": error,
            }
        )
        print(f"{name:<48} {stats['seconds'] * 1e3:9.2f} ms", file=sys.stderr)


def attention_kernels(
    bench: Bench, config: dict, text_len: int, valid: int, image_tokens: int, device: torch.device, dtype: torch.dtype
) -> None:
    """One attention call: diffusers' way (512-padded text, K/V repeated, key mask, default SDPA choice) against ours
    (real tokens only, `enable_gqa`, no mask) under each SDPA backend; a backend that refuses shows as an error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dicache.models.krea2.attention import gqa_attention

    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["attention_head_dim"],
    )

    def qkv(tokens: int) -> list[torch.Tensor]:
        return [torch.randn(1, h, tokens, head_dim, device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads)]

    q, k, v = qkv(text_len + image_tokens)
    mask = torch.ones(1, 1, 1, text_len + image_tokens, dtype=torch.bool, device=device)
    mask[..., valid - SUFFIX_TOKENS : text_len - SUFFIX_TOKENS] = False
    group = heads // kv_heads

    def repeated_masked() -> torch.Tensor:
        k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)

    bench.measure(BASELINE_ROW["attention"], "attention", text_len, repeated_masked)
    q_ours, k_ours, v_ours = qkv(valid + image_tokens)
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cuDNN": SDPBackend.CUDNN_ATTENTION}
    backends |= {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    for label, backend in backends.items():

        def ours(backend=backend) -> torch.Tensor:
            if backend is None:
                return gqa_attention(q_ours, k_ours, v_ours)
            with sdpa_kernel([backend]):
                return gqa_attention(q_ours, k_ours, v_ours)

        bench.measure(f"attention, ours: GQA, no mask, {label}", "attention", valid, ours)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    config = dict(TINY_CONFIG) if args.tiny else _default_config()

    ours, reference, note = build_models(config, device, dtype, args.seed, with_diffusers=not args.no_diffusers)
    weights_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    inputs = make_inputs(args, config, device, dtype)
    text_len, valid, image_tokens = args.text_len, args.valid, inputs["hidden_states"].shape[1]
    bench = Bench(args, config, image_tokens, Timer(device, args.warmup, args.iters))
    ehs, text_mask = inputs["encoder_hidden_states"], inputs["encoder_attention_mask"]

    with torch.inference_mode():
        # Whole forwards; ours with raw text (text path inside) and with a TextConditioning (as the pipeline runs it).
        cond_inputs = {
            **inputs,
            "encoder_hidden_states": ours.encode_text(ehs, text_mask),
            "encoder_attention_mask": None,
        }

        def forwards(tag: str) -> None:
            if reference is not None:
                bench.measure(
                    f"diffusers {tag}", "forward", text_len, lambda: reference(**inputs, return_dict=False)[0], True
                )
            bench.measure(f"ours {tag}, raw text input", "forward", valid, lambda: ours(**inputs), True)
            bench.measure(f"ours {tag}, TextConditioning", "forward", valid, lambda: ours(**cond_inputs))

        # One block on the joint sequence each implementation builds: diffusers 512 + 4096 masked, ours 48 + 4096.
        temb_mod = torch.randn(1, 1, 6 * ours.hidden_size, device=device, dtype=dtype)
        hidden_ours = torch.randn(1, valid + image_tokens, ours.hidden_size, device=device, dtype=dtype)
        rope_ours = ours.rotary_emb(inputs["position_ids"][text_len:], num_leading_zeros=valid)
        if reference is not None:
            hidden_ref = torch.randn(1, text_len + image_tokens, ours.hidden_size, device=device, dtype=dtype)
            rope_ref = reference.rotary_emb(inputs["position_ids"])
            mask_ref = torch.cat([text_mask, text_mask.new_ones(1, image_tokens)], dim=1)[:, None, None, :]

        def blocks(tag: str) -> None:
            if reference is not None:
                ref_block = reference.transformer_blocks[0]
                bench.measure(
                    f"one block, diffusers {tag}",
                    "block",
                    text_len,
                    lambda: ref_block(hidden_ref, temb_mod, rope_ref, mask_ref),
                )
            block = ours.transformer_blocks[0]
            bench.measure(f"one block, ours {tag}", "block", valid, lambda: block(hidden_ours, temb_mod, rope_ours))

        forwards("eager")
        blocks("eager")
        attention_kernels(bench, config, text_len, valid, image_tokens, device, dtype)
        if reference is not None:
            text_fn = lambda: reference.txt_in(reference.text_fusion(ehs, text_mask[:, None, None, :]))  # noqa: E731
            bench.measure(BASELINE_ROW["text"], "text", text_len, text_fn)
        bench.measure(
            "text path, ours (real tokens only)", "text", valid, lambda: ours.encode_text(ehs, text_mask).tokens
        )

        if not args.no_compile:
            options = {"fullgraph": True} | ({"mode": args.compile_mode} if args.compile_mode else {})
            if reference is not None:
                try:
                    reference.compile_repeated_blocks(**options)
                except Exception as err:
                    bench.errors["diffusers compile_repeated_blocks"] = f"{type(err).__name__}: {err}"
            try:
                for block in ours.transformer_blocks:
                    block.compile(**options)
            except Exception as err:
                bench.errors["ours block.compile"] = f"{type(err).__name__}: {err}"
            forwards("blocks compiled")
            blocks("compiled")

    floors = {}
    for label, t in (("padded text", text_len), ("real text only", valid)):
        flops = forward_flops(config, image_tokens, t, with_text_path=False)
        floors[f"{label} ({t} text + {image_tokens} image tokens)"] = {
            "flops": flops,
            "floor_s": flops / (args.peak_tflops * 1e12),
            "text_path_flops": text_path_flops(config, t),
        }
    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(device),
        "versions": _versions(),
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "results")},
            "dtype": dtype_name,
            "image_tokens": image_tokens,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
            "parameters": sum(p.numel() for p in ours.parameters()),
        },
        "weights_gib": weights_gib,
        "floors": floors,
        "rows": bench.rows,
        "errors": bench.errors,
        "note": note,
    }


def _default_config() -> dict:
    import inspect

    params = inspect.signature(Krea2Transformer.__init__).parameters
    return {name: p.default for name, p in params.items() if name != "self"}


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def _versions() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import diffusers

        versions["diffusers"] = diffusers.__version__
    except ImportError:
        versions["diffusers"] = None
    return versions


# ---------------------------------------------------------------------------------------------------------------------
# reporting


def markdown(report: dict) -> str:
    def num(value: float, fmt: str) -> str:
        return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    lines = [
        "| what | tokens | ms (median) | floor ms | TFLOP/s | speed-up vs diffusers eager "
        "| rel. err vs diffusers eager | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['name']} | {r['tokens']} | {num(r['seconds'] * 1e3, '.2f')} | {num(r['floor_s'] * 1e3, '.3g')} "
            f"| {num(r['tflops'], '.3g')} | {num(r['speedup'], '.2f')} | {num(r['rel_err'], '.2e')} "
            f"| {num(r['peak_gib'], '.1f')} |"
        )
    s = report["settings"]
    lines.append("")
    lines.append(
        f"FLOP floor at {s['peak_tflops']:g} TFLOP/s (denoiser: blocks + img_in + final layer; text path apart):"
    )
    for label, f in report["floors"].items():
        lines.append(
            f"- {label}: {f['flops'] / 1e12:.4g} TFLOP -> {f['floor_s'] * 1e3:.4g} ms; "
            f"text path {f['text_path_flops'] / 1e12:.3g} TFLOP"
        )
    lines.append(
        f"- weights {num(report['weights_gib'], '.1f')} GiB (shared by both models); "
        f"{s['parameters'] / 1e9:.2f} B parameters; {s['dtype']}; first compiled call times are in the JSON"
    )
    for name, err in report["errors"].items():
        first_line = err.splitlines()[0] if err else ""
        lines.append(f"- error in {name}: {first_line[:160]}")
    if report["note"]:
        lines.append(f"- note: {report['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    table = markdown(report)
    out = pathlib.Path(args.out or pathlib.Path(os.environ.get("OUT", ".")) / "bench_krea2_forward.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"JSON: {out}\n")
    section = (
        f"## Krea-2 forward, native vs diffusers ({report['date'][:10]})\n\n"
        f"- command: `{report['command']}`\n- machine: {report['machine']}\n"
        f"- versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}\n\n{table}\n"
    )
    publish(section, args.results)


if __name__ == "__main__":
    main()
