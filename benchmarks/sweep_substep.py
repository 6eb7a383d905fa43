"""Issue 43's frontier: today's per-step masks against the cached-step methods, on held-out prompts.

    python benchmarks/sweep_substep.py                       # the Turbo student: sweep_turbo_substep.yaml
    python benchmarks/sweep_substep.py --raw                 # Raw 28 steps CFG 4.5: sweep_raw_substep.yaml
    [--out DIR] [--results FILE] [--threads 1] [--no-progress] ...

Runs `dicache sweep` on the grid (resumable: rerun after an interruption) and publishes one table: per setting its
method (`mask`: whole-step masks with today's forecaster; `fitted`: the fitted output predictor, fitted by the sweep on
the grid's training prompts `fit_prompts`; `tokens`: token subsets on the cached steps), the computed steps, the
compute fraction (blocks run, token subsets counted by their FLOPs), the FLOPs ratio of the whole call (embeddings and
final layer included), and the mean and worst PSNR against the uncached run on the held-out prompts. Other options go
to `dicache sweep`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from publish import command_line, markdown_table, publish  # noqa: E402


def method_of(settings: dict) -> str:
    return {"fitted": "fitted", "tokens": "tokens"}.get(settings.get("cached_step_method"), "mask")


def computed_steps(settings: dict, steps: int) -> str:
    """The steps a setting's static mask computes, e.g. `0,1,3,6`."""
    from dicache.engine.policies import step_mask
    from dicache.settings.cache_config import CacheConfig

    mask = step_mask(CacheConfig.from_env({}, **settings), steps)
    return ",".join(str(i) for i, flag in enumerate(mask) if flag)


def rows_of(results: dict) -> list[dict]:
    rows = []
    for r in results["records"]:
        settings = r.get("settings")
        if r["method"] != "ours" or not settings or settings.get("scm_policy") != "static":
            continue
        method = method_of(settings)
        if method == "tokens":
            method += f" {settings['cached_step_tokens']:g}"
        rows.append(
            {
                "method": method,
                "computed steps": computed_steps(settings, r["schedule"]["steps"]),
                "compute": f"{r['compute_fraction']:.3f}",
                "FLOPs": f"{r['flops_ratio']:.3f}",
                "PSNR mean": f"{r['psnr']:.2f}",
                "worst": f"{r['psnr_min']:.2f}",
            }
        )
    return sorted(rows, key=lambda row: (float(row["compute"]), row["method"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", action="store_true", help="the Raw grid (krea2-tiny, 28 steps, CFG 4.5)")
    parser.add_argument(
        "--out", default=None, help="default: build/sweep-turbo-substep (--raw: build/sweep-raw-substep)"
    )
    parser.add_argument(
        "--grid", default=None, help="default: sweep_turbo_substep.yaml (--raw: sweep_raw_substep.yaml)"
    )
    parser.add_argument("--results", default=None, help="append the section to this file (e.g. RESULTS.md)")
    args, passthrough = parser.parse_known_args(argv)
    name = "raw" if args.raw else "turbo"
    args.out = args.out or f"build/sweep-{name}-substep"
    args.grid = args.grid or str(HERE / "grids" / f"sweep_{name}_substep.yaml")

    from dicache.commands.sweep import main as sweep_main

    argv_sweep = [
        "--grid",
        args.grid,
        "--out",
        args.out,
        *(["--variant", "turbo"] if not args.raw else []),
        *passthrough,
    ]
    status = sweep_main(argv_sweep)
    if status:
        return status
    results = json.loads((pathlib.Path(args.out) / "results.json").read_text())
    rows = rows_of(results)
    meta, schedule = results["meta"], results["records"][0]["schedule"]
    steps, guidance = schedule["steps"], schedule["guidance_scale"]
    lines = [
        f"\n## Issue 43: below step granularity, {meta['model']}, {steps} steps, CFG {guidance:g} (held-out prompts)\n",
        f"Command: `{command_line('sweep_substep.py', argv)}`  ",
        f"Machine: {platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}  ",
        f"{meta['width']} px, {len(meta['samples'])} held-out prompts; PSNR against the uncached {steps} steps. Fitted "
        f"predictors: fitted by the sweep on the grid's training prompts ({pathlib.Path(args.grid).name}: "
        "fit_prompts, fit_seeds other seeds each), never on the judged ones.\n",
        *markdown_table(rows),
        "",
    ]
    publish("\n".join(lines), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
