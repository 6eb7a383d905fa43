"""Run a sweep grid of `benchmarks/grids/` and publish its summary to `benchmarks/RESULTS.md` (and print it).

    python benchmarks/sweep_results.py [--out build/sweep-compare] [--model DIR] [--num-prompts K] [--no-append] [...]
    python benchmarks/sweep_results.py --policies [--device cuda]      # the four-baseline evaluation

Default: the ours-vs-cache-dit sweep of `grids/sweep_grid.yaml` into build/sweep-compare. `--policies`: the
evaluation of `grids/sweep_policies.yaml` into build/sweep-policies — dicache settings against fewer-steps Euler,
fewer-steps Heun, the curved static schedule and cache-dit, with PSNR against the uncached run and against the
200-step Euler reference, per compute bin 0.3..0.8, and the issue's targets.
Other options (e.g. `--device cuda`, `--threads 1`, `--reference-steps 100`, `--baselines euler heun curved`) are
passed on to `dicache sweep`.

The sweep is resumable (rerun the same command after an interruption). The published section names the command, the
machine, the date and, per schedule, the comparison tables (the best dicache setting per compute bin against the best
baseline at its compute, the margin in dB, the targets) and the best PSNR of each method at every compute budget.
The full report stays in `--out` (report.md, results.json, plots/, grids/).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRIDS = HERE / "grids"
RESULTS_MD = HERE / "RESULTS.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", action="store_true", help="run sweep_policies.yaml (four baselines)")
    parser.add_argument("--out", help="output folder (default: build/sweep-compare; --policies: build/sweep-policies)")
    parser.add_argument("--model", help="checkpoint folder (default: the embedded krea2-tiny)")
    parser.add_argument("--grid", help="grid file (default: sweep_grid.yaml; --policies: sweep_policies.yaml)")
    parser.add_argument("--num-prompts", type=int, help="override the grid file's number of prompts")
    parser.add_argument("--schedules", nargs="+", help="override the grid file's schedules")
    parser.add_argument("--note", action="append", default=[], help="a note line for the RESULTS.md section")
    parser.add_argument("--no-append", action="store_true", help="print the section instead of publishing it")
    args, passthrough = parser.parse_known_args(argv)
    args.grid = args.grid or str(GRIDS / ("sweep_policies.yaml" if args.policies else "sweep_grid.yaml"))
    args.out = args.out or ("build/sweep-policies" if args.policies else "build/sweep-compare")

    from publish import publish

    from dicache.commands.sweep import main as sweep_main
    from dicache.sweep.report import render_summary

    sweep_argv = ["--grid", args.grid, "--out", args.out]
    if args.model:
        sweep_argv += ["--model", args.model]
    if args.num_prompts:
        sweep_argv += ["--num-prompts", str(args.num_prompts)]
    if args.schedules:
        sweep_argv += ["--schedules", *args.schedules]
    status = sweep_main(sweep_argv + passthrough)
    if status:
        return status
    import json

    results = json.loads((Path(args.out) / "results.json").read_text())
    command = "python benchmarks/sweep_results.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    section = render_summary(results, command=command.strip(), notes=args.note)
    publish(section, None if args.no_append else RESULTS_MD)
    if args.no_append:
        return 0
    print(f"published to {RESULTS_MD}; full report: {Path(args.out) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
