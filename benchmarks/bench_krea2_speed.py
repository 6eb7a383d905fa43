"""Full-size Krea-2 sampling speed: dicache (native model) against diffusers + cache-dit, in the same run.

Random weights at the real size (12.8 B, shared by both implementations), bf16, 1024² (4096 image tokens), text
padded to 512 with 48 real tokens; denoising only (latent output, no text encoder / VAE). Sections:

- forward: one full forward and one cached forward (Fn=1, Bn=0) of ours, the cached/full ratio; diffusers' forward.
- masks: Turbo 8 steps (no CFG) and Raw 50 steps (CFG) under the step masks cache-dit's presets give
  (slow/medium/fast/ultra), Fn=1 Bn=0 static, ours vs diffusers + cache-dit, same masks on both sides; W=0 so that the
  mask alone decides and both sides compute the same steps.
- sglang: the default settings' pattern when every allowed step is cached (Fn=1 Bn=0 W=4 MC=3, dynamic decisions
  with an always-passing threshold): Turbo 5 of 8 computed, Raw 15 of 50 per branch. `cached_s` times the whole
  pipeline call (text conditioning, starting noise, denoising; latents out), `cached_denoise_s` the denoising phase
  alone (`run_denoise`, what `dicache serve` reports as its denoise phase).
- overhead: Turbo 8 plain vs hooks measuring the diff at every step with nothing cached.
- the same with the transformer blocks compiled (both sides), with recompilations counted after warm-up.
- profile: the top kernels of one full and one cached forward.
- gaps: the GPU timeline (torch.profiler, CUDA) of one forward, of a plain Turbo denoise and of one under SGLang's
  pattern: span, kernel-busy time, idle time and its largest gaps with the kernels around them (where the denoise
  loses time to the host: decisions' synchronisations, launches). CUDA only.
- cachedstep: one cached call under each cached-step method (issue 43) against a full forward: `forecast` (the plain
  cached call, Fn=0: embeddings and final layer only), `fitted` (the fitted output predictor: no forward, one small
  matmul; random weights of the real shape) and `tokens` at the shares `TOKEN_SHARES` (those rows through every
  block against kept keys/values): median wall time of a call after a warm-up request, its share of a full
  forward's time next to its share of the FLOPs (`RequestStats`), and graphs compiled after the warm-up (0 = no
  recompilation). Run it once bf16 and once with `--quantization fp8`.

    python benchmarks/bench_krea2_speed.py [--results benchmarks/RESULTS.md] [--no-compile] [--sections ...]
    python benchmarks/bench_krea2_speed.py --tiny --device cpu      # logic check

Prints a table per section (time, achieved TFLOP/s, speed-up), writes JSON to $OUT/bench_krea2_speed.json.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import pathlib
import platform
import sys
import time
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_krea2_forward import (  # noqa: E402
    TINY_CONFIG,
    block_flops,
    build_models,
    forward_flops,
    gpu_clock,
    text_path_flops,
)
from publish import command_line, markdown_table, publish  # noqa: E402

import dicache  # noqa: E402
from dicache.engine.policies.step_mask import preset_mask  # noqa: E402
from dicache.models.krea2 import Krea2Pipeline  # noqa: E402
from dicache.models.krea2.scheduler import FlowMatchEulerScheduler  # noqa: E402
from dicache.quantization import QUANTIZATION_METHODS, parse_quantization  # noqa: E402

SECTIONS = ("forward", "masks", "sglang", "overhead", "profile", "gaps", "cachedstep")
TOKEN_SHARES = (0.1, 0.2)
"""`cachedstep`: the token shares `cached_step_method=tokens` is timed at."""
SGLANG_PATTERN = {
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "max_warmup_steps": 4,
    "max_continuous_cached_steps": 3,
    "residual_diff_threshold": 1e9,
}
"""SGLang's default cache settings (Fn=1 Bn=0 W=4 MC=3) with a threshold that every allowed step passes."""


def timeline(kernels: list[tuple[float, float, str]], top: int = 5) -> dict:
    """The GPU timeline of `kernels` `(start_us, end_us, name)` (any order, overlaps allowed): span (first start to
    last end), busy (their union) and idle (span - busy) in ms, the number of idle gaps over 20 us, and the `top`
    largest gaps as `"us: before -> after"`."""
    if not kernels:
        raise ValueError("timeline: no kernels")
    ordered = sorted(kernels)
    busy, gaps = 0.0, []
    start, end, name = ordered[0]
    for next_start, next_end, next_name in ordered[1:]:
        if next_start > end:
            busy += end - start
            gaps.append((next_start - end, name, next_name))
            start = next_start
        if next_end >= end:
            end, name = next_end, next_name
    busy += end - start
    span = max(e for _, e, _ in ordered) - ordered[0][0]
    gaps.sort(key=lambda g: -g[0])
    return {
        "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "gaps_over_20us": sum(1 for g in gaps if g[0] > 20),
        "largest_gaps": [f"{g:.0f}: {a[:40]} -> {b[:40]}" for g, a, b in gaps[:top]],
    }


def is_host_wait(warning: warnings.WarningMessage) -> bool:
    """A sync debug mode report of one wait (not the mode's own one-time "prototype feature" notice, which says
    "synchronizing operations")."""
    return "called a synchronizing CUDA operation" in str(warning.message)


def host_waits(run) -> dict[str, int]:
    """Where `run()` made the host wait for the GPU, `{"file:line": count}` of the Python callers (CUDA's sync debug
    mode; the run's own end excluded)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    where = collections.Counter(f"{pathlib.Path(w.filename).name}:{w.lineno}" for w in caught if is_host_wait(w))
    return dict(where)


# the step-mask presets; masks are cache-dit's (cache_dit.steps_mask) when it is importable, else ours
# (docs/architecture.md §2)
PRESETS = ("slow", "medium", "fast", "ultra")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument(
        "--mode",
        choices=("eager", "compiled", "both"),
        default="both",
        help="run the sections eager, with the transformer blocks compiled, or both",
    )
    p.add_argument("--no-diffusers", action="store_true")
    p.add_argument(
        "--quantization",
        default="none",
        choices=("none", *QUANTIZATION_METHODS),
        help="quantize our transformer (pipe.quantize, the method's default exclusions) before compiling; diffusers "
        "stays bf16",
    )
    p.add_argument(
        "--quantization-exclude",
        nargs="+",
        default=None,
        metavar="GROUP_OR_GLOB",
        help="block linears kept in bf16 under --quantization, replacing the defaults (as `dicache serve` takes "
        "it; `none`: every block linear quantised)",
    )
    p.add_argument("--raw-steps", type=int, default=50)
    p.add_argument("--turbo-steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default: 3 for Turbo, 1 for Raw)")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--results", default=None)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--trace",
        default=None,
        help="gaps: also write each run's host + GPU timeline as a Chrome trace, TRACE_<run>.json (chrome://tracing)",
    )
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; allowed: {','.join(SECTIONS)}")
    return args


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.config = TINY_CONFIG if args.tiny else None
        self.size = 128 if args.tiny else 1024
        self.text_len, self.valid = (32, 8) if args.tiny else (512, 48)
        self.results: dict = {"sections": {}}
        self.warm: set = set()
        self.out_path: pathlib.Path | None = None

    # -------------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        import inspect

        from dicache.models.krea2 import Krea2Transformer

        defaults = inspect.signature(Krea2Transformer.__init__).parameters.items()
        config = self.config or {k: p.default for k, p in defaults if k != "self"}  # the released configuration
        self.config = config
        self.ours, self.ref, note = build_models(config, self.device, self.dtype, 0, not self.args.no_diffusers)
        if note:
            print(note)
        gen = torch.Generator(self.device).manual_seed(1)
        shape = (1, self.text_len, config["num_text_layers"], config["text_hidden_dim"])
        self.pe = torch.randn(shape, generator=gen, device=self.device).to(self.dtype)
        self.ne = torch.randn(shape, generator=gen, device=self.device).to(self.dtype)
        self.pm = self._mask(self.valid)
        self.neg_valid = 8 if not self.args.tiny else 6
        self.nm = self._mask(self.neg_valid)
        self.pipe = Krea2Pipeline(transformer=self.ours, scheduler=FlowMatchEulerScheduler())
        self.pipe.set_progress_bar_config(disable=True)
        self.quantization_label = self.args.quantization
        if self.args.quantization != "none":  # what `--quantization fp8 [--quantization-exclude ...]` does
            spec = parse_quantization(self.args.quantization, self.args.quantization_exclude)
            self.pipe.quantize(spec)
            self.quantization_label = f"{spec.method} (bf16: {' '.join(spec.exclude) or 'none'})"
        self.dpipe = None
        if self.ref is not None:
            from diffusers import FlowMatchEulerDiscreteScheduler
            from diffusers import Krea2Pipeline as DiffusersKrea2Pipeline

            sched = FlowMatchEulerDiscreteScheduler(
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=6400,
            )
            self.dpipe = DiffusersKrea2Pipeline(
                scheduler=sched, vae=None, text_encoder=None, tokenizer=None, transformer=self.ref, is_distilled=False
            )
            self.dpipe.set_progress_bar_config(disable=True)
        self.image_tokens = (self.size // 16) ** 2
        self.results["setup"] = {
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.machine(),
            "torch": torch.__version__,
            "dtype": str(self.dtype) + ("" if self.args.quantization == "none" else f" + {self.quantization_label}"),
            "size": self.size,
            "text_len": self.text_len,
            "valid_text": self.valid,
            "params_B": round(sum(p.numel() for p in self.ours.parameters()) / 1e9, 3),
        }

    def _mask(self, valid: int) -> torch.Tensor:
        m = torch.zeros(1, self.text_len, dtype=torch.bool, device=self.device)
        m[:, : valid - 5] = True
        m[:, -5:] = True
        return m

    def run_flops(self, st) -> float:
        """FLOPs a run of ours executed, from its cache stats: per branch, full forwards on the computed steps,
        Fn + Bn blocks (plus embeddings and output) on the cached ones, and the text path once."""
        c, total = self.config, 0.0
        for name, branch in st.branches.items():
            text = self.neg_valid if name == "uncond" else self.valid
            full = forward_flops(c, self.image_tokens, text, with_text_path=False)
            skipped = (c["num_layers"] - st.fn_blocks - st.bn_blocks) * block_flops(c, self.image_tokens + text)
            total += len(branch.computed_steps) * full + len(branch.cached_steps) * (full - skipped)
            total += text_path_flops(c, text) * (2 if name == "batched" else 1)
        return total

    def plain_flops(self, steps: int, cfg: bool) -> float:
        """FLOPs of an uncached run of ours: every step a full forward per branch, the text path once per branch."""
        texts = (self.valid, self.neg_valid) if cfg else (self.valid,)
        c = self.config
        return sum(
            steps * forward_flops(c, self.image_tokens, t, with_text_path=False) + text_path_flops(c, t) for t in texts
        )

    def tflops(self, flops: float, seconds: float) -> float:
        return round(flops / seconds / 1e12, 1)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn, reps: int, warm_key=None) -> dict:
        """Median seconds over `reps` runs, after one warm-up run unless `warm_key` was warmed before; peak memory
        of the timed runs; graphs compiled during the timed runs (0 means no recompilation after warm-up)."""
        from torch._dynamo.utils import counters

        if warm_key is None or warm_key not in self.warm:
            fn()
            self.sync()
            self.warm.add(warm_key)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        graphs = counters["stats"]["unique_graphs"]
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        times.sort()
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        return {
            "s": round(times[len(times) // 2], 4),
            "peak_GiB": None if peak is None else round(peak, 2),
            "new_graphs": counters["stats"]["unique_graphs"] - graphs,
        }

    # -------------------------------------------------------------------------------------------------- runs
    def ours_run(self, steps: int, cfg: bool):
        kw = dict(
            prompt_embeds=self.pe,
            prompt_embeds_mask=self.pm,
            height=self.size,
            width=self.size,
            num_inference_steps=steps,
            seed=0,
            output_type="latent",
        )
        if cfg:
            kw.update(
                negative_prompt_embeds=self.ne, negative_prompt_embeds_mask=self.nm, variant="raw", guidance_scale=4.5
            )
        else:
            kw.update(variant="turbo", guidance_scale=1.0)
        return lambda: self.pipe(**kw)

    def ours_denoise_run(self, steps: int, cfg: bool):
        """The denoising phase alone (`run_denoise`, as `dicache serve`'s denoise phase runs it): the call's plan,
        text conditioning and starting noise are made once, outside the timed function."""
        variant, scale = ("raw", 4.5) if cfg else ("turbo", 1.0)
        plan = self.pipe.plan_call(1, self.size, self.size, steps, scale, 1, "latent", variant)
        with torch.no_grad():
            negative = {"negative_prompt_embeds": self.ne, "negative_prompt_embeds_mask": self.nm} if cfg else {}
            cond, uncond = self.pipe.condition(
                plan, None, prompt_embeds=self.pe, prompt_embeds_mask=self.pm, **negative
            )
        latents = self.pipe.starting_latents(plan, seed=0)
        return lambda: self.pipe.run_denoise(plan, cond, uncond, latents)

    def ref_run(self, steps: int, cfg: bool):
        kw = dict(
            prompt_embeds=self.pe,
            prompt_embeds_mask=self.pm,
            height=self.size,
            width=self.size,
            num_inference_steps=steps,
            guidance_scale=3.5 if cfg else 0.0,
            output_type="latent",
        )
        if cfg:
            kw.update(negative_prompt_embeds=self.ne, negative_prompt_embeds_mask=self.nm)

        def run():
            return self.dpipe(generator=torch.Generator("cpu").manual_seed(0), **kw)

        return run

    def reps(self, steps: int) -> int:
        return self.args.reps or (3 if steps <= 8 else 1)

    def cachedit_mask(self, preset: str, steps: int) -> list[int]:
        try:
            import cache_dit
        except ImportError:
            return preset_mask(preset, steps)
        return list(cache_dit.steps_mask(total_steps=steps, mask_policy=preset))

    @staticmethod
    def bins(mask: list[int]) -> tuple[list[int], list[int]]:
        """Alternating compute/cache runs of a mask that starts with 1."""
        runs, value, count = [], mask[0], 0
        for m in mask:
            if m == value:
                count += 1
            else:
                runs.append(count)
                value, count = m, 1
        runs.append(count)
        return runs[0::2], runs[1::2]

    # -------------------------------------------------------------------------------------------------- sections
    def section_forward(self, tag: str) -> None:
        ours, steps = self.ours, 64
        text = ours.encode_text(self.pe, self.pm)
        x = torch.randn(1, self.image_tokens, self.config["in_channels"], device=self.device, dtype=self.dtype)
        ids = Krea2Pipeline.position_ids(self.size // 16, self.size // 16, self.device)
        t = torch.full((1,), 0.7, device=self.device)
        dicache.enable(
            ours, {"scm_compute_bins": [1], "scm_cache_bins": [steps], "scm_policy": "static", "max_warmup_steps": 0}
        )
        full_times, cached_times = [], []
        with torch.no_grad(), dicache.request(ours, num_inference_steps=steps + 1):
            for i in range(steps):
                self.sync()
                start = time.perf_counter()
                with dicache.step(ours, i, "cond", 0.7):
                    ours(x, text, t, ids)
                self.sync()
                (full_times if i == 0 else cached_times).append(time.perf_counter() - start)
        dicache.disable(ours)
        with torch.no_grad():
            full = self.timed(lambda: ours(x, text, t, ids), 10)
        clock = gpu_clock() if self.device.type == "cuda" else {}  # the state the timed forwards left
        cached = sorted(cached_times[3:])[len(cached_times[3:]) // 2]
        row = {
            "ours_full_s": full["s"],
            "ours_cached_s": round(cached, 5),
            "cached_over_full": round(cached / full["s"], 4),
            "peak_GiB": full["peak_GiB"],
        }
        row.update({k: v for k, v in clock.items() if k in ("sm_clock_MHz", "power_W", "power_limit_W")})
        flops = forward_flops(self.config, self.image_tokens, self.valid, with_text_path=False)
        row["ours_full_tflops"] = round(flops / full["s"] / 1e12, 1)
        row["floor_s"] = round(flops / self.args.peak_tflops / 1e12, 4)
        row["one_block_share"] = round(block_flops(self.config, self.image_tokens + self.valid) / flops, 4)
        if self.ref is not None:
            args = dict(
                hidden_states=x,
                encoder_hidden_states=self.pe,
                timestep=t.to(self.dtype),
                position_ids=torch.cat([torch.zeros(self.text_len, 3, device=self.device), ids]),
                encoder_attention_mask=self.pm,
                return_dict=False,
            )
            with torch.no_grad():
                ref = self.timed(lambda: self.ref(**args), 5)
            row["diffusers_full_s"] = ref["s"]
            padded = forward_flops(self.config, self.image_tokens, self.text_len, with_text_path=True)
            row["diffusers_tflops_executed"] = self.tflops(padded, ref["s"])
            row["speedup_vs_diffusers"] = round(ref["s"] / full["s"], 3)
        self.results["sections"][f"forward{tag}"] = row
        print(f"forward{tag}: {row}", flush=True)

    def section_masks(self, tag: str) -> None:
        rows = []
        for steps, cfg in ((self.args.turbo_steps, False), (self.args.raw_steps, True)):
            for preset in PRESETS:
                mask = self.cachedit_mask(preset, steps)
                compute, cache = self.bins(mask)
                config = {
                    "scm_compute_bins": compute,
                    "scm_cache_bins": cache or [1],
                    "scm_policy": "static",
                    "max_warmup_steps": 0,  # the mask alone decides, on both sides: equal work
                    "max_continuous_cached_steps": -1,
                }
                row = {"steps": steps, "cfg": cfg, "preset": preset, "mask": "".join(map(str, mask))}
                dicache.enable(self.pipe, config)
                ours = self.timed(self.ours_run(steps, cfg), self.reps(steps), warm_key=("ours", steps, cfg, tag))
                st = dicache.stats(self.pipe)
                dicache.disable(self.pipe)
                row.update(
                    ours_s=ours["s"],
                    ours_tflops=self.tflops(self.run_flops(st), ours["s"]),
                    ours_peak_GiB=ours["peak_GiB"],
                    ours_compute=round(st.compute_fraction, 3),
                    ours_computed_calls=st.computed_calls,
                    ours_new_graphs=ours["new_graphs"],
                )
                if self.dpipe is not None:
                    ref = self._cachedit_time(steps, cfg, mask, tag)
                    row.update(
                        cachedit_s=ref["s"],
                        cachedit_computed_calls=ref.get("computed_calls"),
                        cachedit_peak_GiB=ref["peak_GiB"],
                        cachedit_new_graphs=ref["new_graphs"],
                        speedup=round(ref["s"] / ours["s"], 3),
                    )
                rows.append(row)
                print(f"masks{tag}: {row}", flush=True)
        self.results["sections"][f"masks{tag}"] = rows

    def _cachedit_time(self, steps: int, cfg: bool, mask: list[int], tag: str) -> dict:
        import cache_dit
        from cache_dit import DBCacheConfig

        cache_dit.enable_cache(
            self.dpipe,
            cache_config=DBCacheConfig(
                num_inference_steps=steps,
                Fn_compute_blocks=1,
                Bn_compute_blocks=0,
                max_warmup_steps=0,
                residual_diff_threshold=0.24,
                max_continuous_cached_steps=-1,
                steps_computation_mask=mask,
                steps_computation_policy="static",
                enable_separate_cfg=cfg,
            ),
        )
        try:
            timing = self.timed(self.ref_run(steps, cfg), self.reps(steps), warm_key=("cachedit", steps, cfg, tag))
            stats = [s for s in cache_dit.summary(self.dpipe, logging=False) if s.cache_options]
            if stats:  # steps cache-dit cached in the last run, per branch
                cached = len(stats[0].cached_steps or []) + (len(stats[0].cfg_cached_steps or []) if cfg else 0)
                timing["computed_calls"] = steps * (2 if cfg else 1) - cached
            return timing
        finally:
            cache_dit.disable_cache(self.dpipe)

    def section_sglang(self, tag: str) -> None:
        rows = []
        config = SGLANG_PATTERN
        for steps, cfg, sglang_s in ((self.args.turbo_steps, False, 0.92), (self.args.raw_steps, True, 6.3)):
            plain = self.timed(self.ours_run(steps, cfg), self.reps(steps), warm_key=("ours", steps, cfg, tag))
            dicache.enable(self.pipe, config)
            cached = self.timed(self.ours_run(steps, cfg), self.reps(steps), warm_key=("ours", steps, cfg, tag))
            st = dicache.stats(self.pipe)
            denoise = self.timed(
                self.ours_denoise_run(steps, cfg), self.reps(steps), warm_key=("ours", steps, cfg, tag)
            )
            dicache.disable(self.pipe)
            row = {
                "steps": steps,
                "cfg": cfg,
                "plain_s": plain["s"],
                "plain_tflops": self.tflops(self.plain_flops(steps, cfg), plain["s"]),
                "cached_s": cached["s"],
                "cached_tflops": self.tflops(self.run_flops(st), cached["s"]),
                "cached_denoise_s": denoise["s"],
                "computed_per_branch": {k: len(b.computed_steps) for k, b in st.branches.items()},
                "sglang_seed_docs_s": sglang_s,
                "peak_GiB": cached["peak_GiB"],
            }
            rows.append(row)
            print(f"sglang{tag}: {row}", flush=True)
        self.results["sections"][f"sglang{tag}"] = rows

    def section_overhead(self, tag: str) -> None:
        steps = self.args.turbo_steps
        plain = self.timed(self.ours_run(steps, False), 5, warm_key=("ours", steps, False, tag))
        dicache.enable(self.pipe, {"max_warmup_steps": 0, "residual_diff_threshold": 1e-9})
        hooked = self.timed(self.ours_run(steps, False), 5, warm_key=("ours", steps, False, tag))
        assert dicache.stats(self.pipe).cached_calls == 0
        dicache.disable(self.pipe)
        row = {
            "plain_s": plain["s"],
            "hooked_nothing_cached_s": hooked["s"],
            "overhead_pct": round(100 * (hooked["s"] - plain["s"]) / plain["s"], 2),
        }
        self.results["sections"][f"overhead{tag}"] = row
        print(f"overhead{tag}: {row}", flush=True)

    def section_profile(self, tag: str) -> None:
        from torch.profiler import ProfilerActivity, profile

        ours = self.ours
        text = ours.encode_text(self.pe, self.pm)
        x = torch.randn(1, self.image_tokens, self.config["in_channels"], device=self.device, dtype=self.dtype)
        ids = Krea2Pipeline.position_ids(self.size // 16, self.size // 16, self.device)
        t = torch.full((1,), 0.7, device=self.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        dicache.enable(
            ours, {"scm_compute_bins": [1], "scm_cache_bins": [9], "scm_policy": "static", "max_warmup_steps": 0}
        )
        out = {}
        with torch.no_grad(), dicache.request(ours, num_inference_steps=10):
            for i, name in enumerate(("full", "cached", "cached")):
                with profile(activities=activities) as prof, dicache.step(ours, i, "cond", 0.7):
                    ours(x, text, t, ids)
                    self.sync()
                key = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
                table = prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60)
                out[name] = table
        dicache.disable(ours)
        self.results["sections"][f"profile{tag}"] = out
        print(f"profile{tag} full:\n{out['full']}\nprofile{tag} cached:\n{out['cached']}", flush=True)

    def section_gaps(self, tag: str) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self.device.type != "cuda":
            raise SystemExit("--sections gaps: needs a CUDA device (the GPU timeline)")
        steps = self.args.turbo_steps
        text = self.ours.encode_text(self.pe, self.pm)
        x = torch.randn(1, self.image_tokens, self.config["in_channels"], device=self.device, dtype=self.dtype)
        ids = Krea2Pipeline.position_ids(self.size // 16, self.size // 16, self.device)
        t = torch.full((1,), 0.7, device=self.device)
        runs = {
            "forward": (lambda: self.ours(x, text, t, ids), None),
            f"denoise plain, {steps} steps": (self.ours_denoise_run(steps, False), None),
            f"denoise SGLang pattern, {steps} steps": (self.ours_denoise_run(steps, False), SGLANG_PATTERN),
        }
        rows = []
        for name, (run, config) in runs.items():
            if config is not None:
                dicache.enable(self.pipe, config)
            with torch.no_grad():
                wall = self.timed(run, 3)["s"]  # after a warm-up (compiled graphs, cuDNN plans): synced wall time
                waits = host_waits(run)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    run()
                    self.sync()
                if self.args.trace:  # a run of its own: recording host ops slows the host down
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as traced:
                        run()
                        self.sync()
                    traced.export_chrome_trace(f"{self.args.trace}_{'_'.join(name.split(',')[0].split())}.json")
            if config is not None:
                dicache.disable(self.pipe)
            kernels = [
                (e.time_range.start, e.time_range.end, e.name)
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0
            ]
            rows.append({"run": name, "host_waits": waits, "wall_ms": round(wall * 1e3, 3), **timeline(kernels)})
            print(f"gaps{tag}: {rows[-1]}", flush=True)
        self.results["sections"][f"gaps{tag}"] = rows

    def section_cachedstep(self, tag: str) -> None:
        import tempfile

        from torch._dynamo.utils import counters

        from dicache.engine.cached_step import FittedWeights, feature_width

        ours, steps = self.ours, 12
        channels = self.config["in_channels"]
        text = ours.encode_text(self.pe, self.pm)
        gen = torch.Generator(self.device).manual_seed(3)
        x = torch.randn(1, self.image_tokens, channels, generator=gen, device=self.device).to(self.dtype)
        drift = torch.randn(x.shape, generator=gen, device=self.device).to(self.dtype)
        ids = Krea2Pipeline.position_ids(self.size // 16, self.size // 16, self.device)
        mask = (1,) + (0,) * steps
        base = {"scm_compute_bins": [1], "scm_cache_bins": [steps], "scm_policy": "static", "max_warmup_steps": 0}
        base["Fn_compute_blocks"] = 0
        folder = tempfile.mkdtemp(prefix="dicache-bench-")
        weights = {(i, "cond"): 0.01 * torch.randn(feature_width(channels), channels) for i in range(1, steps + 1)}
        path = FittedWeights(steps + 1, mask, weights).save(f"{folder}/predictor.safetensors")
        methods = {
            "forecast": {},
            "fitted": {"cached_step_method": "fitted", "fitted_predictor": str(path)},
            **{f"tokens {s:g}": {"cached_step_method": "tokens", "cached_step_tokens": s} for s in TOKEN_SHARES},
        }
        with torch.no_grad():
            full = self.timed(lambda: ours(x, text, torch.full((1,), 0.7, device=self.device), ids), 10)

        def request() -> list[float]:
            times = []
            with torch.no_grad(), dicache.request(ours, num_inference_steps=steps + 1):
                for i in range(steps + 1):
                    sigma = 0.9 - 0.05 * i
                    t = torch.full((1,), sigma, device=self.device)
                    xi = x + (0.02 * i) * drift
                    self.sync()
                    start = time.perf_counter()
                    with dicache.step(ours, i, "cond", sigma):
                        ours(xi, text, t, ids)
                    self.sync()
                    times.append(time.perf_counter() - start)
            return times

        rows = [
            {
                "method": "full forward",
                "call_ms": round(full["s"] * 1e3, 3),
                "time_share": 1.0,
                "flop_share": 1.0,
                "new_graphs_after_warmup": full["new_graphs"],
            }
        ]
        num_blocks = self.config["num_layers"]
        for name, extra in methods.items():
            dicache.enable(ours, {**base, **extra})
            try:
                request()  # warm-up: compiles what a method's calls need (token subsets: their row count)
                graphs = counters["stats"]["unique_graphs"]
                times = request()
                stats = dicache.stats(ours)
            finally:
                dicache.disable(ours)
            cached = sorted(times[1:])[len(times[1:]) // 2]
            rows.append(
                {
                    "method": name,
                    "call_ms": round(cached * 1e3, 3),
                    "time_share": round(cached / full["s"], 4),
                    "flop_share": round((stats.blocks_run - num_blocks) / steps / num_blocks, 4),
                    "new_graphs_after_warmup": counters["stats"]["unique_graphs"] - graphs,
                }
            )
            print(f"cachedstep{tag}: {rows[-1]}", flush=True)
        self.results["sections"][f"cachedstep{tag}"] = rows

    # -------------------------------------------------------------------------------------------------- compile
    def compile_both(self) -> dict:
        import torch._dynamo

        start = time.perf_counter()
        self.pipe.compile()  # what `--compile` does
        if self.ref is not None:
            self.ref.compile_repeated_blocks(fullgraph=True)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        return {"compile_setup_s": round(time.perf_counter() - start, 2)}

    def save(self) -> None:
        if self.out_path is not None:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            self.out_path.write_text(json.dumps(self.results, indent=1))

    def run(self) -> dict:
        self.setup()
        variants = {"eager": [""], "compiled": ["_compiled"], "both": ["", "_compiled"]}[self.args.mode]
        for tag in variants:
            if tag:
                self.results["compile"] = self.compile_both()
            for section in self.args.sections:
                if section == "profile" and tag == "" and self.args.mode == "both":
                    continue  # profile the compiled (fastest) model
                getattr(self, f"section_{section}")(tag)
                self.save()
        return self.results


def markdown(results: dict, command: str) -> str:
    s = results["setup"]
    lines = [
        f"\n## Krea-2 full-size sampling speed ({datetime.datetime.now():%Y-%m-%d %H:%M})\n",
        f"Command: `{command}`  ",
        f"Machine: {s['device']}, torch {s['torch']}, {s['dtype']}, {s['size']}², text {s['text_len']} "
        f"padded / {s['valid_text']} real, {s['params_B']} B params, random weights\n",
    ]
    for name, data in results["sections"].items():
        if name.startswith("profile"):
            lines += [f"### {name}\n", "```", data["full"], "```", "```", data["cached"], "```\n"]
            continue
        rows = data if isinstance(data, list) else [data]
        lines += [f"### {name}\n", *markdown_table(rows, list(rows[0])), ""]
    if "compile" in results:
        lines.append(f"Compile: {json.dumps(results['compile'])}\n")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"bench_krea2_speed_{args.mode}.json")
    bench.out_path = pathlib.Path(out)
    results = bench.run()
    bench.save()
    publish(markdown(results, command_line("bench_krea2_speed.py", argv)), args.results)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
