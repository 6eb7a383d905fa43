"""Issue 43's frontier on the embedded Turbo student: today's per-step masks against the cached-step methods.

    python benchmarks/sweep_turbo_substep.py [--out build/sweep-turbo-substep] [--results FILE] [--device cpu]

Runs `dicache sweep` on `sweep_turbo_substep.yaml` (resumable: rerun after an interruption) and publishes one table:
per setting its method (`mask`: today's whole-step masks with the input-corrected forecaster; `fitted`: the fitted
output predictor, fitted by the sweep on the training captions; `tokens`: token subsets on the cached steps), the
computed steps, the compute fraction (blocks run, token subsets counted by their FLOPs), the FLOPs ratio of the
whole call (embeddings and final layer included), and the mean and worst PSNR against the uncached 8 steps on the
16 held-out prompts. Other options go to `dicache sweep`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from publish import command_line, markdown_table, publish  # noqa: E402


def method_of(settings: dict) -> str:
    return {"fitted": "fitted", "tokens": "tokens"}.get(settings.get("cached_step_method"), "mask")


def runs(value) -> list[int]:
    """Bins as the record keeps them: a list, or text (`"3,1"`)."""
    return [int(x) for x in value] if isinstance(value, list) else [int(x) for x in str(value).split(",")]


def computed_steps(settings: dict) -> str:
    compute, cache = runs(settings["scm_compute_bins"]), runs(settings["scm_cache_bins"])
    steps, at = [], 0
    for i, run in enumerate(compute):
        steps += range(at, at + run)
        at += run + (cache[i] if i < len(cache) else 0)
    return ",".join(map(str, steps))


def rows_of(results: dict) -> list[dict]:
    rows = []
    for r in results["records"]:
        settings = r.get("settings")
        if r["method"] != "ours" or not settings or "scm_compute_bins" not in settings:
            continue
        method = method_of(settings)
        if method == "tokens":
            method += f" {settings['cached_step_tokens']:g}"
        rows.append(
            {
                "method": method,
                "computed steps": computed_steps(settings),
                "compute": f"{r['compute_fraction']:.3f}",
                "FLOPs": f"{r['flops_ratio']:.3f}",
                "PSNR mean": f"{r['psnr']:.2f}",
                "worst": f"{r['psnr_min']:.2f}",
            }
        )
    return sorted(rows, key=lambda row: (float(row["compute"]), row["method"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/sweep-turbo-substep")
    parser.add_argument("--grid", default=str(HERE / "sweep_turbo_substep.yaml"))
    parser.add_argument("--results", default=None, help="append the section to this file (e.g. RESULTS.md)")
    args, passthrough = parser.parse_known_args(argv)

    from dicache.commands.sweep import main as sweep_main

    argv_sweep = ["--grid", args.grid, "--out", args.out, "--variant", "turbo", *passthrough]
    status = sweep_main(argv_sweep)
    if status:
        return status
    results = json.loads((pathlib.Path(args.out) / "results.json").read_text())
    rows = rows_of(results)
    lines = [
        "\n## Issue 43: the Turbo student below step granularity (held-out prompts)\n",
        f"Command: `{command_line('sweep_turbo_substep.py', argv)}`  ",
        f"Model: {results['meta']['model']}, 8 steps, no CFG, {results['meta']['width']} px, "
        f"{len(results['meta']['samples'])} held-out prompts; PSNR against the uncached 8 steps. Fitted predictors: "
        "fitted on the 6 training captions of turbo_calibration_prompts.json, 8 other seeds each.\n",
        *markdown_table(rows),
        "",
    ]
    publish("\n".join(lines), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
