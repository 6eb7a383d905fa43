"""Krea-2 on a simulated 24 / 32 GB card: dicache's cache-aware layerwise offload beside diffusers' group offloading.

Full-size transformer (28 blocks, width 6144, 12.8 B parameters), random bf16 weights drawn on the GPU then moved to
host memory; 1024² (4096 image tokens), text padded to 512 with 48 real tokens; denoising only (latent output). The
process is capped with `torch.cuda.set_per_process_memory_fraction` at each card size minus `--context-gib` (the CUDA
context a real card spends outside PyTorch's allocator), and the cap is checked: an allocation just over it must fail.

Workloads: Turbo 8 steps (no CFG) and Raw 50 steps with CFG 4.5 (batched: one call per step for cond and uncond, in
every run of ours, resident included), each with the cache off, SGLang's default settings (F1 B0 W4 MC3; random
weights never pass a real threshold, so an always-passing one forces the pattern: Turbo 5 of 8 steps computed, Raw 15
of 50) and the recommended curved schedule at 0.4 (README "Recommended settings": Fn 0, static, damped TaylorSeer).

Runs (`--runs`):
- resident: ours, everything on the GPU, no cap (the reference of every ratio);
- ours: ours with `enable_offload(dit_layerwise_offload=True, gpu_memory_budget=cap)` under each cap;
- group: diffusers' `Krea2Transformer2DModel` with `enable_group_offload(block_level, 1 block per group,
  use_stream=True)` under the first cap, alone (cache off) and with cache-dit forcing the same SGLang pattern
  (group offloading streams every block whatever the cap, so one cap shows it);
- fp8: the transformer quantized with `dicache.quantization.quantize_transformer(model, "fp8")` (when that module
  exists) under the first cap, planned with the same budget: it should stay fully resident.

Per run: seconds, GB copied host->device per image, peak GPU memory (allocated / reserved), the planned peak, the
ratio to the resident time of the same workload and cache, whether the final latents are bitwise equal to the
resident run's, and the time modelled at 25 GB/s (PCIe 4): ours replays its recorded copy/compute trace with copies at
that rate and each block taking its resident time; diffusers' rows take max(measured time, bytes / 25 GB/s).

    python benchmarks/bench_offload.py --tiny --device cuda                        # CUDA preflight, seconds
    python benchmarks/bench_offload.py --results benchmarks/RESULTS.md             # H200, ≈ 5-6 minutes, eager
    python benchmarks/bench_offload.py --runs resident,ours --caps 24 --compile    # a subset, blocks compiled
    python benchmarks/bench_offload.py --tiny --device cpu                         # logic check

Writes $OUT/bench_offload.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import pathlib
import platform
import sys
import time
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_krea2_forward import TINY_CONFIG, build_models  # noqa: E402
from publish import command_line, markdown_table, publish  # noqa: E402

import dicache  # noqa: E402
from dicache.models.krea2 import Krea2Pipeline  # noqa: E402
from dicache.models.krea2.scheduler import FlowMatchEulerScheduler  # noqa: E402
from dicache.offload.plan import GiB  # noqa: E402
from dicache.offload.timeline import model_time  # noqa: E402
from dicache.tuning import RECOMMENDED_FAMILY  # noqa: E402

RUNS = ("resident", "ours", "group", "fp8")
WORKLOADS = ("turbo", "raw")
CACHES = {
    "off": None,
    "sglang": {  # F1 B0 W4 MC3 with an always-passing threshold: the default settings' most-cached pattern
        "Fn_compute_blocks": 1,
        "Bn_compute_blocks": 0,
        "max_warmup_steps": 4,
        "max_continuous_cached_steps": 3,
        "residual_diff_threshold": 1e9,
    },
    "curved0.4": {**RECOMMENDED_FAMILY, "scm_compute_fraction": 0.4},  # README "Recommended settings"
}
MODEL_BANDWIDTH = 25e9  # bytes/s, PCIe 4 x16 in practice


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small 6-block model; --caps count its resident blocks")
    p.add_argument("--device", default="cuda")
    p.add_argument("--runs", default=",".join(RUNS), help=f"subset of {','.join(RUNS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="turbo, raw")
    p.add_argument("--caches", default=",".join(CACHES), help=f"subset of {','.join(CACHES)}")
    p.add_argument("--caps", default=None, help="card sizes in GiB (default 24,32; tiny: resident blocks 1,3)")
    p.add_argument("--context-gib", type=float, default=0.5, help="GiB a real card spends outside the allocator")
    p.add_argument("--turbo-steps", type=int, default=8)
    p.add_argument("--raw-steps", type=int, default=50)
    p.add_argument("--turbo-reps", type=int, default=2)
    p.add_argument("--raw-reps", type=int, default=1)
    p.add_argument("--group-caches", default="off,sglang", help="caches for the diffusers group-offload rows")
    p.add_argument("--compile", action="store_true", help="compile our transformer blocks (adds minutes)")
    p.add_argument("--results", default=None, help="Markdown file to append the tables to")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.runs = _subset(p, "runs", args.runs, RUNS)
    args.workloads = _subset(p, "workloads", args.workloads, WORKLOADS)
    args.caches = _subset(p, "caches", args.caches, tuple(CACHES))
    args.group_caches = _subset(p, "group-caches", args.group_caches, ("off", "sglang"))
    caps = args.caps or ("1,3" if args.tiny else "24,32")
    try:
        args.caps = [float(c) for c in caps.split(",") if c]
    except ValueError:
        p.error(f"--caps={caps!r} is invalid: must be comma-separated numbers")
    if not args.caps:
        p.error("--caps needs at least one value")
    if args.tiny:
        args.turbo_steps, args.raw_steps = min(args.turbo_steps, 4), min(args.raw_steps, 6)
    return args


def _subset(p, name, text, allowed):
    chosen = [s for s in text.split(",") if s]
    bad = sorted(set(chosen) - set(allowed))
    if bad:
        p.error(f"--{name}: unknown {bad}; allowed: {','.join(allowed)}")
    return chosen


class OffloadBench:
    def __init__(self, args) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # the memory-fraction cap needs an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.size = 128 if args.tiny else 1024
        self.text_len, self.valid = (32, 8) if args.tiny else (512, 48)
        self.rows: list[dict] = []
        self.plans: dict[str, dict] = {}
        self.notes: list[str] = []
        self.reference: dict[tuple, dict] = {}
        self.results = {"rows": self.rows, "plans": self.plans, "notes": self.notes}
        self.out_path: pathlib.Path | None = None

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        if self.args.tiny:
            config = {**TINY_CONFIG, "num_layers": 6}
        else:
            from dicache.models.krea2.transformer import Krea2Transformer

            with torch.device("meta"):
                config = dict(Krea2Transformer().config)
        self.config = config
        start = time.perf_counter()
        self.model, _, _ = build_models(config, self.device, self.dtype, 0, False)  # drawn on the device
        self.sync()
        self.pipe = Krea2Pipeline(transformer=self.model, scheduler=FlowMatchEulerScheduler())
        self.pipe.default_size = (self.size, self.size)
        self.pipe.set_progress_bar_config(disable=True)
        gen = torch.Generator(self.device).manual_seed(1)
        shape = (1, self.text_len, config["num_text_layers"], config["text_hidden_dim"])
        self.embeds = torch.randn(shape, generator=gen, device=self.device).to(self.dtype)
        self.negative = torch.randn(shape, generator=gen, device=self.device).to(self.dtype)
        self.mask = self._mask(self.valid)
        self.negative_mask = self._mask(6 if self.args.tiny else 8)
        if self.args.compile:
            for block in self.model.transformer_blocks:
                block.compile(fullgraph=True)
        self.results["setup"] = {
            "device": torch.cuda.get_device_name(self.device) if self.cuda else platform.machine(),
            "torch": torch.__version__,
            "dtype": str(self.dtype),
            "size": self.size,
            "text": f"{self.text_len} padded / {self.valid} real",
            "params_B": round(sum(p.numel() for p in self.model.parameters()) / 1e9, 3),
            "build_s": round(time.perf_counter() - start, 1),
            "compiled": self.args.compile,
        }
        if self.cuda:
            self.results["setup"]["pinned_h2d_GBps"] = self._bandwidth()
            total = torch.cuda.get_device_properties(self.device).total_memory
            self.results["setup"]["total_GiB"] = round(total / GiB, 1)

    def _mask(self, valid: int) -> torch.Tensor:
        mask = torch.zeros(1, self.text_len, dtype=torch.bool, device=self.device)
        mask[:, : valid - 5] = True
        mask[:, -5:] = True
        return mask

    def _bandwidth(self) -> float:
        """Pinned host->device GB/s for one block-sized copy (the unit of streaming)."""
        nbytes = sum(p.numel() * p.element_size() for p in self.model.transformer_blocks[0].parameters())
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dev.copy_(host, non_blocking=True)
        self.sync()
        start = time.perf_counter()
        for _ in range(5):
            dev.copy_(host, non_blocking=True)
        self.sync()
        seconds = (time.perf_counter() - start) / 5
        del host, dev
        return round(nbytes / seconds / 1e9, 1)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------------------------------------ runs
    def steps(self, workload: str) -> int:
        return self.args.turbo_steps if workload == "turbo" else self.args.raw_steps

    def ours(self, workload: str, steps: int | None = None):
        kw = dict(
            prompt_embeds=self.embeds,
            prompt_embeds_mask=self.mask,
            height=self.size,
            width=self.size,
            num_inference_steps=steps or self.steps(workload),
            seed=0,
            output_type="latent",
            cfg_batched=True,
        )
        if workload == "raw":
            kw.update(
                negative_prompt_embeds=self.negative,
                negative_prompt_embeds_mask=self.negative_mask,
                variant="raw",
                guidance_scale=4.5,
            )
        else:
            kw.update(variant="turbo", guidance_scale=1.0)
        return lambda: self.pipe(**kw).images

    def timed(self, fn, reps: int, before_last=None) -> dict:
        """Median seconds over `reps` runs (after the caller's warm-up), peak memory, and the last output."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        times, out = [], None
        for rep in range(reps):
            if before_last is not None and rep == reps - 1:
                before_last()
            start = time.perf_counter()
            out = fn()
            self.sync()
            times.append(time.perf_counter() - start)
        times.sort()
        row = {"s": round(times[len(times) // 2], 3), "out": out}
        if self.cuda:
            row["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated(self.device) / GiB, 2)
            row["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved(self.device) / GiB, 2)
        return row

    def reps(self, workload: str) -> int:
        return self.args.turbo_reps if workload == "turbo" else self.args.raw_reps

    def run_ours(self, setting: str, workload: str, cache: str) -> dict:
        config = CACHES[cache]
        if config is not None:
            dicache.enable(self.pipe, config)
        layerwise = self.pipe.offload.layerwise if self.pipe.offload is not None else None

        def trace() -> None:
            if layerwise is not None:
                layerwise.trace = []

        try:
            timing = self.timed(self.ours(workload), self.reps(workload), before_last=trace)
            stats = dicache.stats(self.pipe) if config is not None else None
        finally:
            if config is not None:
                dicache.disable(self.pipe)
        out = timing.pop("out")
        row = {"setting": setting, "workload": f"{workload}{self.steps(workload)}", "cache": cache, **timing}
        calls = self.steps(workload)
        row["computed_calls"] = stats.computed_calls if stats is not None else calls
        key = (workload, cache)
        if setting == "resident":
            self.reference[key] = {"s": row["s"], "latents": out.float().cpu()}
            row["bytes_per_image"], row["GB_per_image"] = 0, 0.0
        else:
            ref = self.reference.get(key)
            if ref is not None:
                row["ratio_vs_resident"] = round(row["s"] / ref["s"], 3)
                row["bitwise_equal"] = bool(torch.equal(out.float().cpu(), ref["latents"]))
            record = self.pipe.offload.last_request
            row["bytes_per_image"] = record.blocks if record else 0
            row["GB_per_image"] = round(row["bytes_per_image"] / 1e9, 2)
            if layerwise is not None and layerwise.trace is not None:
                row.update(self._modelled(layerwise.trace, ref))
                layerwise.trace = None
        print(f"{row}", flush=True)
        self.rows.append(row)
        return row

    def _modelled(self, trace, ref) -> dict:
        runs = sum(1 for e in trace if e.kind == "run")
        if ref is None or not runs:
            return {}
        block_s = ref["s"] / runs  # each block (with its share of the call's other work) at its resident speed
        out = {"model_25GBps_s": round(model_time(trace, block_s, MODEL_BANDWIDTH).seconds, 3)}
        measured = self.results["setup"].get("pinned_h2d_GBps")
        if measured:
            out["model_measured_bw_s"] = round(model_time(trace, block_s, measured * 1e9).seconds, 3)
        return out

    def warm(self, workload: str) -> None:
        self.ours(workload, steps=2)()
        self.sync()

    # ------------------------------------------------------------------------------------------------ phases
    def phase_resident(self) -> None:
        for workload in self.args.workloads:
            self.warm(workload)
            for cache in self.args.caches:
                self.run_ours("resident", workload, cache)
                self.save()

    def to_host(self) -> None:
        if self.pipe.offload is not None:
            self.pipe.disable_offload()
        self.model.to("cpu")
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def cap_budget(self, cap: float) -> tuple[float, str]:
        """GiB the allocator may use for card size `cap` (tiny: the budget that keeps `cap` blocks resident)."""
        if self.args.tiny:
            from dicache.models.krea2.memory import memory_needs
            from dicache.offload.pipeline import default_reserve_bytes

            needs = memory_needs(self.pipe, self.size, self.size, 1, True, True, dicache.CacheConfig.from_env({}))
            resident, block = int(cap), max(needs.block_bytes)
            slots = min(2, len(needs.block_bytes) - resident)
            total = needs.other_dit_bytes + (resident + slots) * block + needs.dit_activation_bytes + needs.cache_bytes
            total += default_reserve_bytes(self.device, total)  # on CUDA the plan keeps >= 0.5 GiB free on top
            return total / GiB, f"{resident} resident blocks"
        return cap - self.args.context_gib, f"{cap:g} GiB card"

    def apply_cap(self, gib: float) -> dict:
        """Cap the allocator at `gib` and check an allocation just over the cap fails (tiny: no cap, the budget alone
        drives the plan)."""
        if not self.cuda or self.args.tiny:
            return {}
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GiB / total), self.device)
        held = torch.cuda.memory_reserved(self.device)
        over = int(gib * GiB) - held + (256 << 20)
        try:
            probe = torch.empty(over, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            enforced = True
        else:
            del probe
            enforced = False
        torch.cuda.empty_cache()
        if not enforced:
            raise RuntimeError(f"the {gib:.2f} GiB cap is not enforced: {over / GiB:.2f} GiB more could be allocated")
        return {"cap_GiB": round(gib, 2), "cap_enforced": enforced}

    def uncap(self) -> None:
        if self.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def phase_ours(self, cap: float) -> None:
        self.to_host()
        budget, label = self.cap_budget(cap)
        check = self.apply_cap(budget)
        setting = f"ours@{cap:g}"
        start = time.perf_counter()
        plan = self.pipe.enable_offload(
            dit_layerwise_offload=True,
            gpu_memory_budget=budget,
            device=self.device,
            max_height=self.size,
            max_width=self.size,
            max_images=1,
            cfg=True,
        )
        self.plans[setting] = {
            **check,
            "card": label,
            "budget_GiB": round(budget, 3),
            "resident": len(plan.resident),
            "streamed": list(plan.streamed),
            "slots": plan.num_slots,
            "planned_peak_GiB": round(plan.peak_bytes / GiB, 2),
            "setup_s": round(time.perf_counter() - start, 1),
        }
        print(plan.describe(), flush=True)
        for workload in self.args.workloads:
            self.warm(workload)
            for cache in self.args.caches:
                self.run_ours(setting, workload, cache)["planned_peak_GiB"] = self.plans[setting]["planned_peak_GiB"]
                self.save()
        self.uncap()

    def phase_group(self, cap: float) -> None:
        """diffusers' group offloading (block level, one block per group, on a side stream), alone and with
        cache-dit forcing the SGLang pattern, under the same cap."""
        try:
            from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel
            from diffusers import Krea2Pipeline as DiffusersPipeline
            from diffusers.hooks.group_offloading import ModuleGroup
        except ImportError as err:
            self.notes.append(f"group offload rows skipped: diffusers not importable ({err})")
            return
        self.to_host()
        budget, label = self.cap_budget(cap)
        check = self.apply_cap(budget)
        copied = [0]
        sizes: dict[int, int] = {}
        original = ModuleGroup.onload_

        def counted(group) -> None:
            if id(group) not in sizes:
                tensors = [t for m in group.modules for t in (*m.parameters(), *m.buffers())]
                tensors += list(group.parameters or ()) + list(group.buffers or ())
                sizes[id(group)] = sum(t.numel() * t.element_size() for t in dict.fromkeys(tensors))
            copied[0] += sizes[id(group)]
            return original(group)

        def build():
            with torch.device("meta"):
                ref = Krea2Transformer2DModel(**self.config)
            ref.load_state_dict(self.model.state_dict(), strict=True, assign=True)  # shares our host tensors
            ref.eval().requires_grad_(False)
            ref.enable_group_offload(
                onload_device=self.device,
                offload_device=torch.device("cpu"),
                offload_type="block_level",
                num_blocks_per_group=1,
                use_stream=self.cuda,
            )
            scheduler = FlowMatchEulerDiscreteScheduler(
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=6400,
            )
            dpipe = DiffusersPipeline(
                scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=ref, is_distilled=False
            )
            dpipe.set_progress_bar_config(disable=True)
            return dpipe

        ModuleGroup.onload_ = counted
        setting = f"diffusers-group@{cap:g}"
        self.plans[setting] = {**check, "card": label, "budget_GiB": round(budget, 3)}
        # cache-dit cannot be turned off again on a group-offloaded transformer (both wrap its forward) and its
        # settings (CFG separate or not) differ per workload: after the uncached runs, each cache-dit workload but
        # the first gets a fresh pipeline
        dpipe, with_cachedit = None, False
        try:
            for cache in self.args.group_caches:
                for workload in self.args.workloads:
                    if dpipe is None or (cache != "off" and with_cachedit):
                        dpipe = None
                        gc.collect()
                        start = time.perf_counter()
                        dpipe = build()
                        self.plans[setting]["setup_s"] = round(time.perf_counter() - start, 1)
                        self._diffusers_run(dpipe, workload, None, steps=2)  # warm-up
                    with_cachedit = with_cachedit or cache != "off"
                    copied[0] = 0
                    timing = self._diffusers_run(dpipe, workload, cache)
                    self._group_row(setting, workload, cache, timing, copied[0] / max(1, self.reps(workload)))
                    self.save()
        finally:
            ModuleGroup.onload_ = original
            dpipe = None
            gc.collect()
            self.uncap()
            if self.cuda:
                torch.cuda.empty_cache()

    def _diffusers_run(self, dpipe, workload: str, cache: str | None, steps: int | None = None) -> dict:
        steps = steps or self.steps(workload)
        cfg = workload == "raw"
        kw = dict(
            prompt_embeds=self.embeds,
            prompt_embeds_mask=self.mask,
            height=self.size,
            width=self.size,
            num_inference_steps=steps,
            guidance_scale=3.5 if cfg else 0.0,  # diffusers' g = s - 1
            output_type="latent",
        )
        if cfg:
            kw.update(negative_prompt_embeds=self.negative, negative_prompt_embeds_mask=self.negative_mask)

        def run():
            return dpipe(generator=torch.Generator("cpu").manual_seed(0), **kw)

        if cache is None:
            run()
            self.sync()
            return {}
        enabled = cache != "off"
        if enabled:
            import cache_dit
            from cache_dit import DBCacheConfig

            pattern = CACHES[cache]
            config = DBCacheConfig(
                num_inference_steps=steps,
                Fn_compute_blocks=pattern["Fn_compute_blocks"],
                Bn_compute_blocks=pattern["Bn_compute_blocks"],
                max_warmup_steps=pattern["max_warmup_steps"],
                max_continuous_cached_steps=pattern["max_continuous_cached_steps"],
                residual_diff_threshold=pattern["residual_diff_threshold"],
                enable_separate_cfg=cfg,
            )
            cache_dit.enable_cache(dpipe, cache_config=config)
        timing = self.timed(run, self.reps(workload))
        timing.pop("out")
        calls = steps * (2 if cfg else 1)
        if enabled:
            stats = [s for s in cache_dit.summary(dpipe, logging=False) if s.cache_options]
            if stats:
                cached = len(stats[0].cached_steps or []) + (len(stats[0].cfg_cached_steps or []) if cfg else 0)
                calls -= cached
        timing["computed_calls"] = calls
        return timing

    def _group_row(self, setting, workload, cache, timing, copied_bytes) -> None:
        row = {"setting": setting, "workload": f"{workload}{self.steps(workload)}", "cache": cache, **timing}
        ref = self.reference.get((workload, cache))
        if ref is not None:
            row["ratio_vs_resident"] = round(row["s"] / ref["s"], 3)
        row["bytes_per_image"] = int(copied_bytes)
        row["GB_per_image"] = round(copied_bytes / 1e9, 2)
        row["model_25GBps_s"] = round(max(row["s"], copied_bytes / MODEL_BANDWIDTH), 3)
        ours = [
            r
            for r in self.rows
            if r["setting"].startswith("ours@") and r["workload"] == row["workload"] and r["cache"] == cache
        ]
        if ours:
            best = min(ours, key=lambda r: float(r["setting"].split("@")[1]))  # the tightest cap
            row["ours_speedup"] = round(row["s"] / best["s"], 2)
        print(f"{row}", flush=True)
        self.rows.append(row)

    def phase_fp8(self, cap: float) -> None:
        try:
            from dicache.quantization import quantize_transformer
        except ImportError:
            self.notes.append("fp8 run skipped: dicache.quantization is not in this checkout")
            return
        if not self.cuda:
            self.notes.append("fp8 run skipped: needs CUDA")
            return
        self.to_host()
        self.model.to(self.device)
        quantize_transformer(self.model, "fp8")
        gc.collect()
        torch.cuda.empty_cache()
        budget, label = self.cap_budget(cap)
        check = self.apply_cap(budget)
        setting = f"fp8@{cap:g}"
        plan = self.pipe.enable_offload(
            dit_layerwise_offload=True,
            gpu_memory_budget=budget,
            device=self.device,
            max_height=self.size,
            max_width=self.size,
            cfg=True,
        )
        self.plans[setting] = {
            **check,
            "card": label,
            "resident": len(plan.resident),
            "streamed": list(plan.streamed),
            "planned_peak_GiB": round(plan.peak_bytes / GiB, 2),
        }
        print(plan.describe(), flush=True)
        for workload, cache in (("turbo", "off"), ("raw", "sglang")):
            if workload in self.args.workloads:
                self.warm(workload)
                row = self.run_ours(setting, workload, cache)
                row.pop("bitwise_equal", None)  # quantized weights: not the bf16 reference
                self.save()
        self.uncap()

    # ------------------------------------------------------------------------------------------------ driver
    def save(self) -> None:
        if self.out_path is not None:
            self.out_path.write_text(json.dumps(self.results, indent=1))

    def run(self) -> dict:
        self.setup()
        if "resident" in self.args.runs:
            self.phase_resident()
        if "ours" in self.args.runs:
            for cap in self.args.caps:
                self.phase_ours(cap)
        for name, phase in (("group", self.phase_group), ("fp8", self.phase_fp8)):
            if name in self.args.runs:
                try:  # the comparisons must not cost the rows already measured
                    phase(self.args.caps[0])
                except Exception as err:  # noqa: BLE001
                    self.notes.append(f"{name} run failed: {type(err).__name__}: {err}"[:800])
                    print(traceback.format_exc(), flush=True)
                    self.uncap()
        self.save()
        return self.results


PLAN_COLUMNS = ("card", "cap_GiB", "cap_enforced", "budget_GiB", "resident", "streamed", "slots", "planned_peak_GiB")
COLUMNS = (
    "setting",
    "workload",
    "cache",
    "s",
    "ratio_vs_resident",
    "GB_per_image",
    "model_25GBps_s",
    "model_measured_bw_s",
    "peak_alloc_GiB",
    "peak_reserved_GiB",
    "planned_peak_GiB",
    "computed_calls",
    "bitwise_equal",
    "ours_speedup",
)


def markdown(results: dict, command: str) -> str:
    s = results["setup"]
    lines = [
        f"\n## Krea-2 on small GPUs: cache-aware layerwise offload ({datetime.datetime.now():%Y-%m-%d %H:%M})\n",
        f"Command: `{command}`  ",
        f"Machine: {s['device']}, torch {s['torch']}, {s['dtype']}, {s['size']}², text {s['text']}, "
        f"{s['params_B']} B params, random weights; compiled blocks: {s['compiled']}; pinned host->device "
        f"{s.get('pinned_h2d_GBps', '-')} GB/s\n",
        "| plan | " + " | ".join(PLAN_COLUMNS) + " |",
        "|---" * (len(PLAN_COLUMNS) + 1) + "|",
    ]
    for name, plan in results["plans"].items():
        lines.append(f"| {name} | " + " | ".join(str(plan.get(k, "")) for k in PLAN_COLUMNS) + " |")
    lines += ["", *markdown_table(results["rows"], COLUMNS)]
    lines += [
        "",
        "ratio_vs_resident: against ours fully resident without a cap, same workload and cache (CFG batched). "
        "model_25GBps_s: ours = its recorded copy/compute trace replayed with copies at 25 GB/s and blocks at their "
        "resident speed; diffusers = max(measured, bytes / 25 GB/s). ours_speedup: diffusers' time / ours at the "
        "tightest cap.",
    ]
    lines += [f"Note: {n}" for n in results["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = OffloadBench(args)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "bench_offload.json")
    bench.out_path = pathlib.Path(out)
    start = time.perf_counter()
    results = bench.run()
    results["setup"]["wall_s"] = round(time.perf_counter() - start, 1)
    bench.save()
    publish(markdown(results, command_line("bench_offload.py", argv)), args.results)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
