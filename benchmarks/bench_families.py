"""Every registered diffusers DiT family cached by dicache and by cache-dit 1.5.3, on diffusers' tiny configs (CPU).

For each family (`tests/tiny_families.py`, `tests/tiny_families_more.py`: random tiny transformer and VAE, random
prompt embeddings, 8 steps) the uncached images, then `dicache.enable(pipe, case.settings)` with the block lists
joined (the default: one stack), then — for families cache-dit caches otherwise — in cache-dit's layout
(`lists="separate"`, or AuraFlow's single list), then cache-dit's `enable_cache` with the same settings (Fn 1, Bn 0,
W 1, MC 3, RDT 0.5 unless the case needs more to cache with random weights). PSNR of each against the uncached
images; cached calls over all transformers of the pipeline (dicache) or of the first one (cache-dit's summary).
Random tiny weights, so the figures check that both engines make the same decisions and estimates, not image
quality.

    python benchmarks/bench_families.py --results benchmarks/RESULTS.md
    python benchmarks/bench_families.py --families Flux.1 Chroma

Then the model features that address blocks by index (SD3 skip-layer guidance, Flux ControlNet residuals) with a
cache that caches nothing, against the uncached run. Prints Markdown tables and appends them to --results. Needs
the `bench` extra (cache-dit 1.5.3).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from publish import command_line, publish  # noqa: E402
from tiny_families import (  # noqa: E402
    CASES,
    STEPS,
    cache_dit_layout,
    cache_dit_psnr,
    flux_controlnet,
    generate,
    psnr,
    sd3,
)

import dicache  # noqa: E402
from dicache.adapters import find_family, find_pipeline_adapter  # noqa: E402


def calls_cached(pipe) -> tuple[int, int]:
    """(cached, all) transformer calls of the last request, over every cached transformer of `pipe`."""
    cached = total = 0
    for transformer in find_pipeline_adapter(pipe).transformers(pipe):
        stats = dicache.stats(transformer)
        cached += stats.cached_calls
        total += stats.cached_calls + stats.computed_calls
    return cached, total


def run_family(name: str) -> dict:
    case = CASES[name]
    pipe, kwargs = case.build()
    family = find_family(pipe.transformer)
    plain = generate(pipe, kwargs)
    dicache.enable(pipe, case.settings)
    joined = generate(pipe, kwargs)
    cached, total = calls_cached(pipe)
    row = {
        "family": name,
        "pipeline": type(pipe).__name__,
        "lists": " + ".join(f"{path} {form.label}" for path, form in family.lists),
        "rdt": case.settings["residual_diff_threshold"],
        "cached": f"{cached}/{total}",
        "psnr": psnr(plain, joined),
        "layout": None,
    }
    layout = cache_dit_layout(case)
    if layout:  # cache-dit caches the lists otherwise: each on its own, or only some of them
        dicache.enable(pipe, case.settings, **layout)
        row["layout"] = psnr(plain, generate(pipe, kwargs))
    dicache.disable(pipe)
    if case.cache_dit_fails:
        try:
            cache_dit_psnr(case, pipe, kwargs, plain)
            row["cache_dit"], row["cd_cached"] = None, "ran"
        except Exception as error:  # noqa: BLE001 (its failure is the figure)
            row["cache_dit"], row["cd_cached"] = None, f"fails ({type(error).__name__})"
    else:
        row["cache_dit"], row["cd_cached"] = cache_dit_psnr(case, pipe, kwargs, plain)
    row["same_layout"] = row["layout"] if row["layout"] is not None else row["psnr"]
    return row


FEATURES = {
    "SD3 skip-layer guidance (blocks 1, 2 skipped in the guidance call)": lambda: sd3(
        skip_guidance_layers=[1, 2], skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0
    ),
    "Flux ControlNet residuals (FluxControlNetPipeline)": flux_controlnet,
}
"""Model features that address blocks by index, run with a cache that caches nothing."""


def run_feature(name: str) -> dict:
    """PSNR against the uncached run of dicache with `policy="never"` and of cache-dit with RDT 0 (neither caches)."""
    import cache_dit

    pipe, kwargs = FEATURES[name]()
    plain = generate(pipe, kwargs)
    dicache.enable(pipe, {"policy": "never"})
    ours = psnr(plain, generate(pipe, kwargs))
    dicache.disable(pipe)
    cache_dit.enable_cache(
        pipe,
        cache_config=cache_dit.DBCacheConfig(residual_diff_threshold=0.0, Fn_compute_blocks=1, Bn_compute_blocks=0),
    )
    try:
        theirs = psnr(plain, generate(pipe, kwargs))
    finally:
        cache_dit.disable_cache(pipe)
    return {"feature": name, "ours": ours, "cache_dit": theirs}


def db(value: float | None) -> str:
    if value is None:
        return ""
    return "inf" if value == float("inf") else f"{value:.3f}"


def delta(ours: float, theirs: float | None) -> str:
    """dicache minus cache-dit in dB ("equal" when both images equal the uncached ones; empty without cache-dit)."""
    if theirs is None:
        return ""
    return "equal" if ours == theirs else f"{ours - theirs:+.3f}"


def markdown(rows: list[dict], features: list[dict], command: str) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"\n## Diffusers DiT families (`bench_families.py`), {now}\n",
        f"- command: `{command}`",
        f"- machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, 1-min load average {load:.1f}, "
        f"torch {torch.__version__}, 1 torch thread",
        f"- models: diffusers' tiny test configs with random weights (`tests/tiny_families.py`, "
        f"`tests/tiny_families_more.py`), {STEPS} steps, random prompt embeddings; PSNR of the decoded images (Cosmos, "
        "Allegro: of the latents) against the uncached ones",
        "- settings: Fn 1, Bn 0, W 1, RDT as listed (0.5 unless random weights cache nothing there), MC 3 for both "
        "engines (cache-dit 1.5.3 `enable_cache` with its registered adapter, `enable_separate_cfg` as the pipeline "
        "calls CFG)",
        "",
        "| family | pipeline | block lists (form) | RDT | cached calls | PSNR joined | PSNR cache-dit's layout "
        "| cache-dit PSNR | cache-dit cached | Δ same layout |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['pipeline']} | {r['lists']} | {r['rdt']} | {r['cached']} | {db(r['psnr'])} | "
            f"{db(r['layout'])} | {db(r['cache_dit'])} | {r['cd_cached']} | "
            f"{delta(r['same_layout'], r['cache_dit'])} |"
        )
    lines += [
        "",
        "cached calls: over every transformer of the pipeline and every CFG branch (dicache, joined lists); cache-dit "
        "cached: cond + uncond steps of its first cache context. PSNR cache-dit's layout: where cache-dit's adapter "
        'caches the lists otherwise, dicache in that layout (`lists="separate"`: each block list its own cache; '
        "AuraFlow: the single-stream list only, via `form=`); Δ compares dicache in cache-dit's layout with "
        "cache-dit. Bria 3.2: cache-dit 1.5.3 fails on its first call (its adapter declares the blocks "
        "`(h, e) -> (h, e)`; they return `(e, h)`).",
        "",
    ]
    if features:
        lines += [
            'Features that address blocks by index, with a cache that caches nothing (dicache `policy="never"`, '
            "cache-dit RDT 0), PSNR against the uncached run (inf: bitwise equal):",
            "",
            "| feature | dicache | cache-dit |",
            "|---|---|---|",
            *(f"| {f['feature']} | {db(f['ours'])} | {db(f['cache_dit'])} |" for f in features),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=sorted(CASES), help="family names (default: all)")
    parser.add_argument("--no-features", action="store_true", help="skip the block-indexed features table")
    parser.add_argument("--results", help="append the Markdown table to this file (e.g. benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(CASES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; known: {sorted(CASES)}")
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")
    torch.set_num_threads(1)
    rows = [run_family(name) for name in args.families]
    features = [run_feature(name) for name in FEATURES] if not args.no_features else []
    publish(markdown(rows, features, command_line("bench_families.py", argv)), args.results)


if __name__ == "__main__":
    main()
