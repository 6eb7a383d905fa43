"""Issue 43's frontier: today's per-step masks against the cached-step methods, on held-out prompts.

    python benchmarks/sweep_substep.py                       # the Turbo student: sweep_turbo_substep.yaml
    python benchmarks/sweep_substep.py --raw                 # Raw 28 steps CFG 4.5: sweep_raw_substep.yaml
    python benchmarks/sweep_substep.py --grid benchmarks/grids/sweep_turbo_substep_fp8.yaml --dtype bfloat16 \
        --device cuda --profile turbo-fp8.json             # bf16 and FP8 side by side, a calibrated profile too
    [--out DIR] [--results FILE] [--threads 1] [--no-progress] ...

Runs `dicache sweep` on the grid (resumable: rerun after an interruption) and publishes one table: per setting its
method (`mask`: whole-step masks with today's forecaster; `fitted`: the fitted output predictor, fitted by the sweep on
the grid's training prompts `fit_prompts`; `tokens`: token subsets on the cached steps; `profile NAME`: a `--profile`
file's settings, its predictor as calibrated), the computed steps, the compute fraction (blocks run, token subsets
counted by their FLOPs), the FLOPs ratio of the whole call (embeddings and final layer included), and the mean and
worst PSNR against the uncached run on the held-out prompts. With a quantization axis (`quantization: [none, fp8]`:
the methods `ours-fp8` / `ours-int8` / `ours-fp8-emulated`; `--quantization none fp8-emulated` runs FP8's arithmetic on
a CPU) each weights kind gets its own PSNR columns, measured against the unquantized
uncached run, and the quantized model's uncached row says what the quantization alone costs. Other options go to
`dicache sweep`.
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

from dicache.sweep.spec import QUANTIZED_METHODS  # noqa: E402

QUANTIZED_LABELS = {method: quantization.upper() for quantization, method in QUANTIZED_METHODS.items()}
"""The quantized methods of the sweep's quantization axis (`ours-fp8`, ...) and the weights they stand for."""


def method_of(settings: dict) -> str:
    """`mask`, `fitted`, `tokens <share>` or `uncached`."""
    if settings.get("policy") == "never":
        return "uncached"
    method = {"fitted": "fitted", "tokens": "tokens"}.get(settings.get("cached_step_method"), "mask")
    return f"tokens {settings['cached_step_tokens']:g}" if method == "tokens" else method


def computed_steps(settings: dict, steps: int) -> str:
    """The steps a setting's static mask computes, e.g. `0,1,3,6` (`all` for an uncached setting)."""
    from dicache.engine.policies import step_mask
    from dicache.settings.cache_config import CacheConfig

    if settings.get("policy") == "never":
        return "all"
    mask = step_mask(CacheConfig.from_env({}, **settings), steps)
    return ",".join(str(i) for i, flag in enumerate(mask) if flag)


def weights_of(record: dict, unquantized: str) -> str:
    """The weights a record ran with: the quantized method's kind, else `unquantized` (the sweep's dtype)."""
    return QUANTIZED_LABELS.get(record["method"], unquantized)


def rows_of(results: dict, profiles: dict[str, str] | None = None) -> list[dict]:
    """One row per setting (static masks, the quantized models' uncached runs, `--profile` cells: `profiles` maps
    their cell labels to the profile names), sorted by compute. Without quantized records: `PSNR mean` / `worst`
    columns; with them, `<weights> PSNR` / `<weights> worst` per weights kind (the unquantized first)."""
    meta_id = results["meta"].get("model_id", "")
    dtype = meta_id.split("|")[1] if meta_id.count("|") >= 2 else "unquantized"
    unquantized = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
    quantized = any(r["method"] in QUANTIZED_LABELS for r in results["records"])
    rows: dict[str, dict] = {}
    for r in results["records"]:
        settings = r.get("settings")
        if r["method"] not in ("ours", *QUANTIZED_LABELS) or not settings:
            continue
        method = method_of(settings)
        if r.get("setting") in (profiles or {}):
            method = f"profile {profiles[r['setting']]}"
        elif settings.get("scm_policy") != "static" and method != "uncached":
            continue
        steps = computed_steps(settings, r["schedule"]["steps"])
        row = rows.setdefault(
            r.get("setting") or json.dumps(settings, sort_keys=True),  # one row per cell, each weights kind a column
            {
                "method": method,
                "computed steps": steps,
                "compute": f"{r['compute_fraction']:.3f}",
                "FLOPs": f"{r['flops_ratio']:.3f}",
            },
        )
        if quantized:
            weights = weights_of(r, unquantized)
            row[f"{weights} PSNR"], row[f"{weights} worst"] = f"{r['psnr']:.2f}", f"{r['psnr_min']:.2f}"
        else:
            row["PSNR mean"], row["worst"] = f"{r['psnr']:.2f}", f"{r['psnr_min']:.2f}"
    if quantized:  # the unquantized model's uncached run is the reference itself
        for row in rows.values():
            if row["method"] == "uncached":
                row.setdefault(f"{unquantized} PSNR", "reference")
    return sorted(rows.values(), key=lambda row: (float(row["compute"]), row["method"], row["computed steps"]))


def profile_cell(path: str) -> dict:
    """A grid cell (`{key: [value]}`) of a settings profile's values that differ from the built-in defaults (a
    predictor file's path made absolute)."""
    from dicache.settings.cache_config import CacheConfig
    from dicache.settings.profiles import check_profile

    settings = check_profile(path)
    defaults = CacheConfig.from_env({}).model_dump()
    return {k: [v] for k, v in settings.items() if k != "enable_cache" and v != defaults.get(k)}


def grid_with_profiles(grid: str, profiles: list[str], out: pathlib.Path) -> tuple[str, dict[str, str]]:
    """`grid` with one more cell per profile, written as JSON into `out` (the sweep's folder); returns its path and
    cell label -> profile name (the file name without `.json`)."""
    from dicache.sweep.errors import SweepSpecError
    from dicache.sweep.files import read_data_file
    from dicache.sweep.spec import make_cell

    data = read_data_file(grid, "grid file", SweepSpecError)
    cells = data.get("grid") if isinstance(data, dict) else None
    if not isinstance(cells, list):
        raise SweepSpecError(f"grid file {grid!r}: --profile needs a grid file whose `grid` is a list of cells")
    names: dict[str, str] = {}
    for path in profiles:
        cell = profile_cell(path)
        cells.append(cell)
        names[make_cell({k: v[0] for k, v in cell.items()}).label] = pathlib.Path(path).stem
    out.mkdir(parents=True, exist_ok=True)
    written = out / "grid_with_profiles.json"
    written.write_text(json.dumps({**data, "grid": cells}, indent=1))
    return str(written), names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", action="store_true", help="the Raw grid (krea2-tiny, 28 steps, CFG 4.5)")
    parser.add_argument(
        "--out", default=None, help="default: build/sweep-turbo-substep (--raw: build/sweep-raw-substep)"
    )
    parser.add_argument(
        "--grid", default=None, help="default: sweep_turbo_substep.yaml (--raw: sweep_raw_substep.yaml)"
    )
    parser.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="PATH",
        help="a settings profile (dicache calibrate; a fitted predictor as calibrated): its settings as one more "
        "cell, judged on the grid's held-out prompts (repeatable)",
    )
    parser.add_argument("--results", default=None, help="append the section to this file (e.g. RESULTS.md)")
    args, passthrough = parser.parse_known_args(argv)
    name = "raw" if args.raw else "turbo"
    args.out = args.out or f"build/sweep-{name}-substep"
    args.grid = args.grid or str(HERE / "grids" / f"sweep_{name}_substep.yaml")
    grid, profiles = args.grid, {}
    if args.profile:
        from dicache.errors import DicacheError

        try:
            grid, profiles = grid_with_profiles(args.grid, args.profile, pathlib.Path(args.out))
        except DicacheError as exc:  # a missing or invalid profile or grid file: said, named
            print(f"sweep_substep.py: error: {exc}", file=sys.stderr)
            return 2

    from dicache.commands.sweep import main as sweep_main

    argv_sweep = [
        "--grid",
        grid,
        "--out",
        args.out,
        *(["--variant", "turbo"] if not args.raw else []),
        *passthrough,
    ]
    status = sweep_main(argv_sweep)
    if status or "--dry-run" in passthrough:  # a dry run lists the cells (a grid's check): nothing to tabulate
        return status
    results = json.loads((pathlib.Path(args.out) / "results.json").read_text())
    rows = rows_of(results, profiles)
    meta, schedule = results["meta"], results["records"][0]["schedule"]
    steps, guidance = schedule["steps"], schedule["guidance_scale"]
    quantized = sorted({QUANTIZED_LABELS[m] for m in meta.get("methods", []) if m in QUANTIZED_LABELS})
    against = f"the uncached {steps} steps" + (" of the unquantized model" if quantized else "")
    host, _, device = meta.get("machine", "?").rpartition(", ")  # `<OS arch>, <threads>, <CPU or the GPU's name>`
    model_id = meta.get("model_id", "")
    dtype = model_id.split("|")[1] if model_id.count("|") >= 2 else "?"
    lines = [
        f"\n## Issue 43: below step granularity, {meta['model']}, {steps} steps, CFG {guidance:g} (held-out prompts)\n",
        f"Command: `{command_line('sweep_substep.py', argv)}`  ",
        f"Machine: {device}, torch {meta.get('versions', {}).get('torch', '?')}, {dtype}; {host}  ",
        f"{meta['width']} px, {len(meta['samples'])} held-out prompts; PSNR against {against}. Fitted "
        f"predictors: fitted by the sweep on the grid's training prompts ({pathlib.Path(args.grid).name}: "
        "fit_prompts, fit_seeds other seeds each), never on the judged ones"
        + (
            f"; {', '.join(quantized)} ones on the quantized model, steered to the unquantized uncached run"
            if quantized
            else ""
        )
        + (f"; `profile` rows: {', '.join(args.profile)} as calibrated" if args.profile else "")
        + ".\n",
        *markdown_table(rows),
        "",
    ]
    publish("\n".join(lines), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
