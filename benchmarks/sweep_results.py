"""Run the ours-vs-cache-dit sweep of `benchmarks/sweep_grid.yaml` and append its summary to `benchmarks/RESULTS.md`.

    python benchmarks/sweep_results.py [--out build/sweep-compare] [--model DIR] [--num-prompts K] [--no-append] [...]

Other options (e.g. `--device cuda`, `--threads 1`) are passed on to `dicache sweep`.

The sweep is resumable (rerun the same command after an interruption). The appended section names the command, the
machine, the date and, per schedule, the best PSNR of each method at every compute budget. The full report stays in
`--out` (report.md, results.json, plots/, grids/).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS_MD = HERE / "RESULTS.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/sweep-compare", help="sweep output folder (default: %(default)s)")
    parser.add_argument("--model", help="checkpoint folder (default: the embedded krea2-tiny)")
    parser.add_argument("--grid", default=str(HERE / "sweep_grid.yaml"), help="grid file (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, help="override the grid file's number of prompts")
    parser.add_argument("--schedules", nargs="+", help="override the grid file's schedules")
    parser.add_argument("--note", action="append", default=[], help="a note line for the RESULTS.md section")
    parser.add_argument("--no-append", action="store_true", help="print the section instead of appending it")
    args, passthrough = parser.parse_known_args(argv)

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
    if args.no_append:
        print(section)
        return 0
    if not RESULTS_MD.is_file():
        RESULTS_MD.write_text("# Benchmark results\n")
    with RESULTS_MD.open("a") as f:
        f.write("\n" + section)
    print(f"appended to {RESULTS_MD}; full report: {Path(args.out) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
