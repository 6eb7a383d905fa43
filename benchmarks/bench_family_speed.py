"""Full-size Flux.1-dev sampling speed: dicache's calibrated step mask against cache-dit 1.5.3 at the same settings.

diffusers' `FluxPipeline` around a `FluxTransformer2DModel` of Flux.1-dev's configuration (19 double + 38 single
blocks, 24 heads × 128, 11.9 B parameters) with random weights, built on the GPU in bf16; no text encoders (random
T5 prompt embeddings (1, 512, 4096) and pooled CLIP ones (1, 768)), no VAE (latent output: denoising only); 1024²
(4096 image tokens), 28 steps, guidance embedding 3.5, no CFG (Flux.1-dev is guidance-distilled), seeded generator.

Runs (each the median of `--reps` timed pipeline calls after one warm-up, synchronised), eager and with
`pipe.transformer.compile_repeated_blocks(fullgraph=True)` (compiled once; every run warms up again):

- no cache;
- dicache hooks on, nothing cached (`policy="never"`), and cache-dit caching nothing (RDT 0);
- dicache with `--profile PATH` (read as `dicache generate --profile` reads it: defaults < profile <
  SGLANG_CACHE_DIT_*), default Fn 1, Bn 0, W 0, cache-dit's `medium` step mask (static), TaylorSeer order 1;
- cache-dit with the same settings through dicache's own mapping (`dicache.sweep.cachedit.enable_equivalent`). Where
  the profile holds settings cache-dit has no counterpart of (Fn 0, a forecaster other than TaylorSeer, ...),
  cache-dit gets the nearest ones (listed), and dicache also runs with exactly those.

Checks: both caches computed the same steps (dicache.stats, cache_dit.summary), and their latents agree (PSNR of
`0.5 + latents / 8`, rel. L2). Exit status 1 when the computed steps differ or a mode failed (after writing everything).

    python benchmarks/bench_family_speed.py --out $OUT/bench_family_speed.json [--profile flux.json]
    python benchmarks/bench_family_speed.py --tiny --modes eager      # the same code on a tiny Flux, CPU

Prints a Markdown table (`publish`, `--results`), writes JSON to `--out` (default `$OUT/bench_family_speed.json`
when $OUT is set). Needs diffusers and cache-dit 1.5.3 (the `bench` extra).
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

from publish import command_line, publish  # noqa: E402

import dicache  # noqa: E402
from dicache.engine.policies import step_mask  # noqa: E402
from dicache.errors import ConfigError  # noqa: E402
from dicache.settings.cache_config import CacheConfig  # noqa: E402
from dicache.settings.profiles import cache_config  # noqa: E402
from dicache.sweep.cachedit import NO_EQUIVALENT, cached_steps, enable_equivalent, unsupported_reason  # noqa: E402
from dicache.sweep.spec import Schedule  # noqa: E402

FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
"""Flux.1-dev's transformer configuration (black-forest-labs/FLUX.1-dev, transformer/config.json)."""

TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=3,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)

FLUX_DEV_SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    shift=3.0,
    use_dynamic_shifting=True,
)
"""Flux.1-dev's scheduler configuration (FlowMatchEulerDiscreteScheduler)."""

DEFAULT_SETTINGS = {
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "max_warmup_steps": 0,
    "scm_preset": "medium",
    "scm_policy": "static",
    "enable_taylorseer": True,
    "taylorseer_order": 1,
}
"""The settings without `--profile`: F1B0, cache-dit's `medium` mask (15 of 28 steps computed) alone deciding."""

FORECAST_ONLY = ("taylorseer_damping", "forecaster", "taylorseer_distance")
"""Settings that do nothing unless TaylorSeer (or DMD) forecasts."""

MODES = ("eager", "compiled")
STEPS = 28
GUIDANCE_EMBEDDING = 3.5
TOLERANCE = 0.02
"""The issue's criterion: dicache's time within 2 % of cache-dit's at the same computed steps."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=None, metavar="PATH", help="dicache settings profile (dicache calibrate)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: eager, compiled (default: both)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per run (the median is reported)")
    p.add_argument("--tiny", action="store_true", help="a tiny Flux config on the CPU (logic check)")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of the compiled mode (eager: CPU checks)"
    )
    p.add_argument("--out", default=None, help="JSON results (default: $OUT/bench_family_speed.json when $OUT is set)")
    p.add_argument("--results", default=None, help="results page to publish to (e.g. benchmarks/RESULTS.md)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not args.modes:
        p.error(f"--modes {','.join(args.modes)!r}: unknown {unknown}; allowed: {','.join(MODES)}")
    if args.reps < 1:
        p.error(f"--reps {args.reps}: must be >= 1")
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.out is None and os.environ.get("OUT"):
        args.out = str(pathlib.Path(os.environ["OUT"]) / "bench_family_speed.json")
    return args


def dicache_settings(profile: str | None) -> CacheConfig:
    """The dicache side: `profile` as the commands read it (defaults < profile < SGLANG_CACHE_DIT_*), else
    `DEFAULT_SETTINGS` over the built-in defaults."""
    if profile is None:
        return CacheConfig.defaults().merged(DEFAULT_SETTINGS)
    return cache_config(profile)


def cache_dit_counterpart(config: CacheConfig) -> tuple[CacheConfig, dict[str, object]]:
    """The settings cache-dit runs for `config` and the changes that alter what runs: `config` itself when cache-dit
    has an equivalent, else the nearest (Fn 0 -> 1; a forecaster other than plain step-distance TaylorSeer, or DMD ->
    TaylorSeer of the same order, order 1 for DMD; a cached step predicted by the fitted predictor or by a token
    subset -> the cached residual, the same step mask). Forecaster settings that do nothing with TaylorSeer off are
    reset silently. ConfigError for a policy other than dbcache."""
    if config.policy != "dbcache":
        raise ConfigError(f"policy={config.policy!r}: this benchmark compares step masks / dbcache with cache-dit")
    defaults = CacheConfig.defaults()
    changes: dict[str, object] = {}
    if config.Fn_compute_blocks < 1:
        changes["Fn_compute_blocks"] = 1
    forecasting = config.enable_taylorseer or config.enable_dmd
    inert: dict[str, object] = {}
    for key in (*NO_EQUIVALENT, "taylorseer_distance", "fitted_predictor", "cached_step_tokens"):
        default = getattr(defaults, key)
        if getattr(config, key) != default:
            (changes if forecasting or key not in FORECAST_ONLY else inert)[key] = default
    if config.enable_dmd:
        changes.update(enable_dmd=False, enable_taylorseer=True, taylorseer_order=1)
    counterpart = config.merged({**inert, **changes})
    reason = unsupported_reason(counterpart)
    if reason is not None:  # a setting cache_dit_settings refuses that this function does not map
        raise ConfigError(f"no cache-dit counterpart of the dicache settings: {reason}")
    return counterpart, changes


def label(config: CacheConfig) -> str:
    """Short description of the settings that decide the computed steps and the forecast."""
    mask = step_mask(config, STEPS)
    parts = [f"F{config.Fn_compute_blocks}B{config.Bn_compute_blocks}"]
    if mask is not None:
        parts.append(f"{config.scm_policy} mask {''.join(map(str, mask))}")
    else:
        parts.append(f"W{config.max_warmup_steps} RDT {config.residual_diff_threshold:g}")
    if config.enable_dmd:
        parts.append("DMD")
    elif config.enable_taylorseer:
        parts.append(f"{config.forecaster} order {config.taylorseer_order}")
    return ", ".join(parts)


class Bench:
    """The pipeline, its call and the runs. `runs[mode][name]` = {"s", "times", "computed", "latents"}."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.config = TINY if args.tiny else FLUX_DEV
        self.size = 64 if args.tiny else 1024
        self.text_len = 8 if args.tiny else 512
        self.schedule = Schedule(STEPS, embedded_guidance=GUIDANCE_EMBEDDING)
        self.ours = dicache_settings(args.profile)
        self.theirs, self.changes = cache_dit_counterpart(self.ours)
        self.labels = (label(self.ours), label(self.theirs))  # a mask that does not fit STEPS is refused here
        self.runs: dict[str, dict[str, dict]] = {}
        self.setup: dict = {}
        self.errors: dict[str, str] = {}

    def build(self) -> None:
        """The pipeline: the transformer initialised on the device (random weights), then cast to the dtype."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

        start = time.perf_counter()
        torch.manual_seed(0)
        with self.device:
            transformer = FluxTransformer2DModel(**self.config)
        transformer = transformer.to(self.dtype).eval().requires_grad_(False)
        self.pipe = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER),
            vae=None,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
            transformer=transformer,
        )
        self.pipe.set_progress_bar_config(disable=True)
        gen = torch.Generator(self.device).manual_seed(1)
        self.prompt_embeds = torch.randn(
            1, self.text_len, self.config["joint_attention_dim"], generator=gen, device=self.device
        ).to(self.dtype)
        self.pooled = torch.randn(1, self.config["pooled_projection_dim"], generator=gen, device=self.device).to(
            self.dtype
        )
        self.sync()
        self.setup = {
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.machine(),
            "torch": torch.__version__,
            "dtype": str(self.dtype).replace("torch.", ""),
            "model": "of a tiny config (--tiny)" if self.args.tiny else "at Flux.1-dev's size",
            "size": self.size,
            "text_len": self.text_len,
            "params_B": round(sum(p.numel() for p in transformer.parameters()) / 1e9, 3),
            "build_s": round(time.perf_counter() - start, 1),
        }
        print(f"built: {self.setup}", flush=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def call(self) -> torch.Tensor:
        """One pipeline call; the final packed latents (1, image tokens, in_channels), float32 on the CPU."""
        out = self.pipe(
            prompt_embeds=self.prompt_embeds,
            pooled_prompt_embeds=self.pooled,
            height=self.size,
            width=self.size,
            num_inference_steps=STEPS,
            guidance_scale=GUIDANCE_EMBEDDING,
            generator=torch.Generator("cpu").manual_seed(0),
            output_type="latent",
        )
        return out.images

    def timed(self, mode: str, name: str, computed: Callable[[], int]) -> None:
        """One warm-up, then `reps` synchronised calls; records the median, the times, the computed steps of the
        last call (`computed()`) and its latents."""
        start = time.perf_counter()
        self.call()
        self.sync()
        warmup = time.perf_counter() - start
        times = []
        for _ in range(self.args.reps):
            self.sync()
            start = time.perf_counter()
            latents = self.call()
            self.sync()
            times.append(time.perf_counter() - start)
        row = {
            "s": statistics.median(times),
            "times": [round(t, 4) for t in times],
            "warmup_s": round(warmup, 2),
            "computed": computed(),
            "latents": latents.float().cpu(),
        }
        self.runs.setdefault(mode, {})[name] = row
        print(f"{mode} {name}: {row['s']:.3f} s (warm-up {warmup:.1f} s), {row['computed']} computed", flush=True)

    def dicache_run(self, mode: str, name: str, config: CacheConfig) -> None:
        dicache.enable(self.pipe, config)
        try:
            self.timed(mode, name, lambda: dicache.stats(self.pipe).computed_calls)
        finally:
            dicache.disable(self.pipe)

    def cache_dit_run(self, mode: str, name: str, config: CacheConfig) -> None:
        import cache_dit

        enable_equivalent(self.pipe, config, self.schedule)
        try:
            self.timed(mode, name, lambda: STEPS - len(cached_steps(self.pipe, cfg=False).get("cond", [])))
        finally:
            cache_dit.disable_cache(self.pipe)

    def run_mode(self, mode: str) -> None:
        if mode == "compiled":
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            start = time.perf_counter()
            self.pipe.transformer.compile_repeated_blocks(fullgraph=True, backend=self.args.compile_backend)
            self.setup["compile_setup_s"] = round(time.perf_counter() - start, 2)
        self.timed(mode, "no cache", lambda: STEPS)
        self.dicache_run(mode, "dicache never", CacheConfig.defaults().merged({"policy": "never"}))
        self.cache_dit_run(mode, "cache-dit RDT 0", CacheConfig.defaults().merged({"residual_diff_threshold": 0.0}))
        self.dicache_run(mode, "dicache", self.ours)
        if self.changes:
            self.dicache_run(mode, "dicache, cache-dit's settings", self.theirs)
        self.cache_dit_run(mode, "cache-dit", self.theirs)

    def run(self) -> dict:
        """Every mode; a mode that fails after another completed is reported (`errors`) instead of losing the rest."""
        self.build()
        for mode in self.args.modes:
            try:
                self.run_mode(mode)
            except Exception as exc:
                if not any(m in self.runs for m in self.args.modes if m != mode):
                    raise
                self.errors[mode] = f"{type(exc).__name__}: {exc}"
                self.runs.pop(mode, None)
                print(f"{mode} failed: {self.errors[mode]}", flush=True)
        return self.results()

    def results(self) -> dict:
        rows = []
        names = list(next(iter(self.runs.values())))
        for name in names:
            row = {"run": name, "label": self.describe(name)}
            for mode, runs in self.runs.items():
                r = runs[name]
                row[mode] = {k: v for k, v in r.items() if k != "latents"}
                ref = runs[self.reference(name)]
                row[mode]["vs_cache_dit"] = r["s"] / ref["s"]
                row[mode]["vs_no_cache"] = r["s"] / runs["no cache"]["s"]
                row[mode]["psnr_vs_no_cache_db"] = latent_psnr(r["latents"], runs["no cache"]["latents"])
                row[mode]["psnr_vs_cache_dit_db"] = latent_psnr(r["latents"], ref["latents"])
                row[mode]["rel_l2_vs_cache_dit"] = rel_l2(r["latents"], ref["latents"])
                row[mode]["finite"] = bool(torch.isfinite(r["latents"]).all())
            rows.append(row)
        return {
            "setup": self.setup,
            "steps": STEPS,
            "guidance_embedding": GUIDANCE_EMBEDDING,
            "profile": self.args.profile,
            "dicache_settings": self.ours.model_dump(),
            "cache_dit_settings": self.theirs.model_dump(),
            "cache_dit_changes": self.changes,
            "rows": rows,
            "errors": self.errors,
            "same_computed_steps": self.same_computed_steps(rows),
        }

    @staticmethod
    def reference(name: str) -> str:
        """The cache-dit run at the same computed steps as run `name`."""
        return "cache-dit RDT 0" if name in ("no cache", "dicache never", "cache-dit RDT 0") else "cache-dit"

    def describe(self, name: str) -> str:
        return {
            "no cache": "no cache",
            "dicache never": 'dicache, hooks on, nothing cached (`policy="never"`)',
            "cache-dit RDT 0": "cache-dit, nothing cached (RDT 0)",
            "dicache": f"dicache, {'profile' if self.args.profile else 'default'}: {self.labels[0]}",
            "dicache, cache-dit's settings": f"dicache, cache-dit's settings: {self.labels[1]}",
            "cache-dit": f"cache-dit 1.5.3: {self.labels[1]}",
        }[name]

    @staticmethod
    def same_computed_steps(rows: list[dict]) -> bool:
        """Whether every run computed as many steps as its cache-dit reference, in every mode."""
        by_name = {r["run"]: r for r in rows}
        for r in rows:
            ref = by_name[Bench.reference(r["run"])]
            for mode in MODES:
                if mode in r and r[mode]["computed"] != ref[mode]["computed"]:
                    return False
        return True


def latent_psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of `0.5 + a / 8` against `0.5 + b / 8` (peak 1: ±4σ of unit-variance latents); inf when equal."""
    mse = ((a.double() - b.double()) / 8).pow(2).mean().item()
    if math.isnan(mse):
        return float("nan")
    return float("inf") if mse == 0 else -10 * math.log10(mse)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fmt_db(value: float) -> str:
    return "inf" if value == float("inf") else f"{value:.1f}"


def markdown(results: dict, command: str) -> str:
    s = results["setup"]
    modes = [m for m in MODES if m in results["rows"][0]]
    compile_note = f", compile setup {s['compile_setup_s']} s" if "compile_setup_s" in s else ""
    lines = [
        f"\n## Flux.1-dev full-size sampling speed: dicache vs cache-dit ({datetime.datetime.now():%Y-%m-%d %H:%M})\n",
        f"- command: `{command}`",
        f"- machine: {s['device']}, torch {s['torch']}, {s['dtype']}",
        f"- model: diffusers `FluxPipeline`, `FluxTransformer2DModel` {s['model']} ({s['params_B']} B params), random "
        f"weights built in {s['build_s']} s{compile_note}; {s['size']}², {results['steps']} steps, guidance embedding "
        f"{results['guidance_embedding']:g}, no CFG, random prompt embeddings ({s['text_len']} tokens), latent output "
        "(no VAE)",
        f"- settings: {'profile ' + results['profile'] if results['profile'] else 'default (no --profile)'}; "
        "cache-dit through `dicache.sweep.cachedit.enable_equivalent`"
        + (
            f"; cache-dit has no counterpart of some, it gets: {results['cache_dit_changes']}"
            if results["cache_dit_changes"]
            else ""
        ),
        "- each time: median of the timed calls after one warm-up (compiled: "
        "`pipe.transformer.compile_repeated_blocks(fullgraph=True)`, once); ÷ cache-dit: over cache-dit at the same "
        "computed steps (RDT 0 for the uncached rows); PSNR of `0.5 + latents / 8`",
        "",
    ]
    header = "| run | computed steps |"
    rule = "|---|---|"
    for m in modes:
        header += f" {m} s | {m} ÷ cache-dit | {m} PSNR vs cache-dit (dB) |"
        rule += "---|---|---|"
    lines += [header, rule]
    for r in results["rows"]:
        computed = "/".join(sorted({str(r[m]["computed"]) for m in modes}))
        line = f"| {r['label']} | {computed} of {results['steps']} |"
        for m in modes:
            x = r[m]
            finite = "" if x["finite"] else " (non-finite latents)"
            line += f" {x['s']:.3f} | {x['vs_cache_dit']:.3f} | {fmt_db(x['psnr_vs_cache_dit_db'])}{finite} |"
        lines.append(line)
    lines.append("")
    by_name = {r["run"]: r for r in results["rows"]}
    for m in modes:
        ours, never = by_name["dicache"][m], by_name["dicache never"][m]
        verdict = "meets" if ours["vs_cache_dit"] <= 1 + TOLERANCE else "misses"
        lines.append(
            f"- {m}: dicache {ours['s']:.3f} s vs cache-dit {by_name['cache-dit'][m]['s']:.3f} s at "
            f"{ours['computed']} vs {by_name['cache-dit'][m]['computed']} computed steps: "
            f"{(ours['vs_cache_dit'] - 1) * 100:+.1f} % ({verdict} issue 42's ≤ +2 %); hooks with nothing cached "
            f"{(never['vs_no_cache'] - 1) * 100:+.1f} % vs no cache; dicache vs cache-dit latents: PSNR "
            f"{fmt_db(ours['psnr_vs_cache_dit_db'])} dB, rel. L2 {ours['rel_l2_vs_cache_dit']:.2e}; dicache vs no "
            f"cache: PSNR {fmt_db(ours['psnr_vs_no_cache_db'])} dB"
        )
    for mode, error in results["errors"].items():
        lines.append(f"- **{mode} failed**: {error[:300]}")
    if not results["same_computed_steps"]:
        lines.append("- **MISMATCH**: a dicache run computed another number of steps than its cache-dit reference")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")
    args = parse_args(argv)
    try:
        bench = Bench(args)  # settings checked (and refused) before the model is built
    except ConfigError as exc:
        print(f"bench_family_speed: {exc}", file=sys.stderr)
        return 2
    results = bench.run()
    text = markdown(results, command_line("bench_family_speed.py", argv))
    results["markdown"] = text
    if args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1, allow_nan=True))
    publish(text, args.results)
    return 0 if results["same_computed_steps"] and not results["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
