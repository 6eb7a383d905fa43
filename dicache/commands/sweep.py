"""`dicache sweep`: measure speedup vs fidelity over a grid of cache settings, against the same-compute baselines.

Baselines: fewer-steps Euler, fewer-steps Heun, the `curved` static step-reuse schedule (all uncached, native
pipeline) and cache-dit (when installed). Fidelity against the uncached run of the schedule and against a
high-accuracy reference (uncached Euler, `--reference-steps`, default 200).
Writes into `--out`: results.jsonl (resumable), results.json, report.md, plots/*.png, grids/<schedule>/*.png.
Values given on the command line override a `--grid` file, which overrides the built-in (or `--quick`) defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Literal

import torch

from ..errors import DicacheError
from ..models.families import checkpoint_schedule, is_family_model
from ..models.krea2.checkpoints import default_checkpoint, heldout_prompts_file
from ..models.options import ModelChoice
from ..settings.devices import resolve_device
from ..settings.options import FlagOptions, option
from ..sweep import spec as S
from ..sweep.cachedit import INSTALL_HINT, cache_dit_available
from ..sweep.launch import FAMILY_BASELINES, run_sweep
from ..sweep.prompts import FALLBACK_PROMPTS, read_prompts
from ..sweep.report import write_report
from ..sweep.settings import grid_axes
from ..sweep.spec import FILE_KEYS, SweepSpecError
from ..sweep.store import RESULTS_JSON
from .fields import add_options
from .shared import RunOptions

HELP = "sweep cache settings: compute fraction, time and fidelity (PSNR/SSIM/rel-L2) vs cache-dit and fewer steps"

GRID_AXES = grid_axes()
"""(flag, request key, value type) of the grid axes: `--<short name>` of each `AXIS_KEYS` setting."""
QUICK_PROMPTS = 2
DEFAULT_PROMPTS = 8


class SweepOptions(FlagOptions):
    """What `dicache sweep` measures and where it writes (the model is `ModelChoice`; the grid axes come from the
    cache settings' declarations, `GRID_AXES`). Unset values come from a `--grid` file, else the built-in (or
    `--quick`) defaults; the spec checks the values that a grid file can also give (`dicache.sweep.spec`)."""

    out: str = option("sweep-results", flag="--out", help="output folder")
    grid: str | None = option(
        None, flag="--grid", metavar="FILE", help="YAML/JSON grid file (keys: " + ", ".join(FILE_KEYS) + ")"
    )
    quick: bool = option(False, flag="--quick", help="a small grid, 2 prompts, 8 and 28:4.5 steps (minutes)")
    schedules: list[str] | None = option(None, flag="--schedules", metavar="SCHED", help="e.g. 8 28:4.5 50:4.5")
    prompts: str | None = option(
        None,
        flag="--prompts",
        metavar="FILE",
        help="prompt file: text (one a line) or JSON (default: the checkpoint's heldout_prompts.json, held-out split)",
    )
    prompt: list[str] | None = option(
        None, flag="--prompt", repeat=True, metavar="TEXT", help="a prompt (repeatable; replaces --prompts)"
    )
    seeds: list[int] | None = option(None, flag="--seeds", help="seeds for every prompt (default: the file's, else 0)")
    num_prompts: int | None = option(
        None,
        flag="--num-prompts",
        ge=1,
        help=f"use the first K prompts (default {DEFAULT_PROMPTS}, --quick {QUICK_PROMPTS})",
    )
    height: int | None = option(
        None,
        flag="--height",
        ge=1,
        help="image height in px (default: heldout_prompts.json's image_size, else the pipeline's)",
    )
    width: int | None = option(None, flag="--width", ge=1, help="image width in px (default: as --height)")
    methods: list[Literal["ours", "cache-dit"]] | None = option(
        None, flag="--methods", help="cached methods (default: ours, plus cache-dit when installed)"
    )
    targets: list[float] | None = option(
        None, flag="--targets", help="PSNR targets in dB for recommendations (default 30 35 40)"
    )
    baselines: list[str] | None = option(
        None,
        flag="--baselines",
        metavar="NAME",
        help="same-compute baselines: euler heun curved cachedit (default: all, cachedit when installed)",
    )
    reference_steps: str | None = option(
        None,
        flag="--reference-steps",
        metavar="N",
        help="steps of the high-accuracy reference (uncached Euler) for PSNR-vs-reference; 0 = off (default 200)",
    )
    compute_targets: list[float] | None = option(
        None,
        flag="--compute-targets",
        metavar="F",
        help="compute fractions where the baselines run and the report's bins sit (default 0.3 0.4 ... 0.8)",
    )
    quantization: list[Literal[("none", *S.QUANTIZED_METHODS)]] | None = option(
        None,
        flag="--quantization",
        help="the quantization axis: fp8 / int8 / fp8-emulated add the method ours-fp8 / ours-int8 / ours-fp8-emulated "
        "(the model in FP8 / INT8 / FP8 emulated in float32, uncached and with every cell, measured against the bf16 "
        "references; needs --dtype bfloat16; FP8 needs a GPU with FP8, INT8 and emulated FP8 run on the CPU too) "
        "(default: none)",
    )
    device: str | None = option(
        None, flag="--device", default_text="cpu", help="torch device for both pipelines, e.g. cuda"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32", flag="--dtype", help="both pipelines' dtype (a sweep resumes only in the dtype it started in)"
    )
    dry_run: bool = option(False, flag="--dry-run", help="print the cells and samples, run nothing")
    report_only: bool = option(False, flag="--report-only", help="redraw report.md and plots from results.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  dicache sweep --quick --out sweep-quick\n"
        "  dicache sweep --schedules 8 28:4.5 --RDT 0.08 0.12 0.24 --TS 0 1 --out sweep-rdt\n"
        "  dicache sweep --grid benchmarks/grids/sweep_grid.yaml --out sweep-full\n"
        "schedules: STEPS[:CFG_SCALE[:VARIANT]], CFG scale in the standard convention uncond + s·(cond − uncond),\n"
        "  s = 1 (or omitted) = no CFG; e.g. 8 (Turbo-like), 28:4.5 and 50:4.5 (Raw-like). cache-dit gets g = s − 1.\n"
        "grid axes take lists; their cartesian product is swept. TS 0 = TaylorSeer off.\n"
        "baselines: euler heun curved cachedit (default: all; cachedit only when cache-dit is installed).\n"
        "An interrupted sweep resumes: rerun the same command; finished cells are not recomputed."
    )
    add_options(parser, ModelChoice)
    add_options(parser, SweepOptions)
    add_options(parser, RunOptions)
    axes = parser.add_argument_group("grid axes (each a list; overrides the grid file's grid)")
    for flag, key, kind in GRID_AXES:  # derived from the cache settings' declarations (sweep.settings.grid_axes)
        axes.add_argument(
            f"--{flag.replace('_', '-')}",
            dest=f"axis_{flag}",
            nargs="+",
            type=kind if kind is not int else _int,
            metavar="V",
            help=key,
        )


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def build_spec(args: argparse.Namespace, log: Any = print) -> Any:
    """The `SweepSpec` of the parsed arguments (CLI > grid file > `--quick`/default presets)."""
    file: dict[str, Any] = S.read_grid_file(args.grid) if args.grid else {}
    model = args.model or file.get("model")
    variant = getattr(args, "variant", None)
    if model is None and variant == "turbo":
        model = str(default_checkpoint("turbo"))

    grid: Any = S.QUICK_GRID if args.quick else S.DEFAULT_GRID
    grid = file.get("grid", grid)
    axes = {key: getattr(args, f"axis_{flag}") for flag, key, _ in GRID_AXES if getattr(args, f"axis_{flag}")}
    if axes:
        grid = axes
    cells = S.expand_grid(grid)

    family = model is not None and is_family_model(model)
    defaults = S.QUICK_SCHEDULES if args.quick else S.DEFAULT_SCHEDULES
    if variant == "turbo":
        defaults = S.TURBO_SCHEDULES  # a distilled model runs without CFG
    if family:  # a family's pipeline: the schedule its checkpoint is meant for (dicache.json), else its defaults
        steps, guidance = checkpoint_schedule(model)
        defaults = (f"{steps}:{guidance:g}",)
    schedules = args.schedules or file.get("schedules") or defaults
    schedules = [S.Schedule.parse(s) for s in (schedules if isinstance(schedules, list | tuple) else [schedules])]

    seeds = args.seeds if args.seeds is not None else file.get("seeds")
    limit = args.num_prompts or file.get("num_prompts") or (QUICK_PROMPTS if args.quick else DEFAULT_PROMPTS)
    if args.prompt:
        pairs = [(p, None) for p in args.prompt]
    elif args.prompts:
        pairs = S.read_prompts(args.prompts, split="heldout")
    elif file.get("prompts"):
        prompts = file["prompts"]
        pairs = [(p, None) for p in ([prompts] if isinstance(prompts, str) else prompts)]
    else:
        pairs = _default_prompts(model)
    samples = S.make_samples(pairs, seeds, limit)

    # cache-dit runs when `methods` names it (an error if it is missing) or when `baselines` (default: all) names
    # `cachedit` and `methods` does not exclude it (then skipped with a note if it is missing)
    notes: list[str] = []
    methods = args.methods or file.get("methods")
    baselines_given = args.baselines if args.baselines is not None else file.get("baselines")
    default_baselines = (*FAMILY_BASELINES, "cachedit") if family else S.BASELINES  # Heun, curved: Krea-2 only
    baselines, want_cachedit = S.parse_baselines(baselines_given if baselines_given is not None else default_baselines)
    asked = methods is not None and "cache-dit" in methods
    if methods is None:
        methods = ["ours"] + (["cache-dit"] if want_cachedit else [])
    elif baselines_given is not None and want_cachedit and not asked:
        methods = [*methods, "cache-dit"]
    if "cache-dit" in methods and not asked and not cache_dit_available():
        methods = [m for m in methods if m != "cache-dit"]
        note = f"{INSTALL_HINT}; the cache-dit baseline is skipped"
        notes.append(note)
        log(f"note: {note}")
    quantizations = args.quantization or file.get("quantization") or []
    for q in [quantizations] if isinstance(quantizations, str) else quantizations:
        if q != "none" and q not in S.QUANTIZED_METHODS:
            raise S.SweepSpecError(f"quantization {q!r} is unknown; allowed: none, {', '.join(S.QUANTIZED_METHODS)}")
        if q != "none" and S.QUANTIZED_METHODS[q] not in methods:
            methods = [*methods, S.QUANTIZED_METHODS[q]]
    targets = args.targets or file.get("targets") or S.DEFAULT_TARGETS
    reference_steps = args.reference_steps if args.reference_steps is not None else file.get("reference_steps", "")
    reference_steps = S.DEFAULT_REFERENCE_STEPS if reference_steps == "" else S.parse_reference_steps(reference_steps)
    compute_targets = args.compute_targets or file.get("compute_targets") or S.DEFAULT_COMPUTE_TARGETS
    cachedit_grid = file.get("cachedit_grid")
    fit_prompts = file.get("fit_prompts")
    return S.SweepSpec(
        samples=samples,
        schedules=schedules,
        cells=cells,
        methods=tuple(methods),
        model=model,
        height=args.height or file.get("height") or _default_size(model),
        width=args.width or file.get("width") or _default_size(model),
        targets=tuple(float(t) for t in targets),
        baselines=baselines,
        reference_steps=reference_steps,
        compute_targets=tuple(_fraction(v) for v in compute_targets),
        cachedit_cells=None if cachedit_grid is None else S.expand_grid(cachedit_grid),
        fit_prompts=None if fit_prompts is None else S.make_samples(S.read_prompts(fit_prompts, split="train"), None),
        fit_seeds=file.get("fit_seeds", 8),
        extra={"notes": notes},
    )


def _fraction(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SweepSpecError(f"compute_targets value {value!r} is invalid: must be a number in (0, 1]") from None


def _heldout_file(model: str | None) -> Path:
    """`heldout_prompts.json` beside the checkpoint, else beside its base checkpoint (it may not exist)."""
    return heldout_prompts_file(model)


def _default_prompts(model: str | None) -> list[tuple[str, int | None]]:
    """The checkpoint's held-out prompts (heldout_prompts.json) when it has them, else built-in ones."""
    path = _heldout_file(model)
    if path.is_file():
        return read_prompts(path, split="heldout")
    return [(p, None) for p in FALLBACK_PROMPTS]


def _default_size(model: str | None) -> int | None:
    """The training resolution the held-out set names (`image_size`), else None (the pipeline's default size)."""
    path = _heldout_file(model)
    if not path.is_file():
        return None
    try:
        size = json.loads(path.read_text()).get("image_size")
    except (json.JSONDecodeError, AttributeError):
        return None
    return int(size) if isinstance(size, int) else None


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.report_only:
        path = out / RESULTS_JSON
        if not path.is_file():
            raise SweepSpecError(f"--report-only: {path} does not exist (run the sweep first)")
        report = write_report(json.loads(path.read_text()), out)
        print(f"wrote {report}")
        return 0
    spec = build_spec(args)
    if args.device is not None:
        resolve_device(args.device)  # a device this machine lacks stops here, before any model is built
    if args.dry_run:
        print(f"model: {spec.model or 'embedded krea2-tiny'}; methods: {', '.join(spec.methods)} + fewer steps")
        print(
            "baselines: "
            + (", ".join(spec.baselines) or "none")
            + f" at compute {', '.join(f'{f:g}' for f in spec.compute_targets)}; reference: "
            + (f"{spec.reference_steps}-step Euler" if spec.reference_steps else "off")
        )
        print("schedules: " + "; ".join(s.name for s in spec.schedules))
        print(f"size: {spec.height or 'pipeline default'} x {spec.width or 'pipeline default'} px")
        print(f"samples ({len(spec.samples)}): " + "; ".join(f"{p!r} seed {s}" for p, s in spec.samples))
        print(f"cells ({len(spec.cells)}):")
        for cell in spec.cells:
            print(f"  {cell.label}")
        if spec.cachedit_cells is not None and "cache-dit" in spec.methods:
            print(f"cache-dit cells ({len(spec.cachedit_cells)}):")
            for cell in spec.cachedit_cells:
                print(f"  {cell.label}")
        return 0

    previous = torch.get_num_threads()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        results = run_sweep(
            spec, out, progress=not args.no_progress, dtype=getattr(torch, args.dtype), device=args.device
        )
    finally:
        torch.set_num_threads(previous)
    print(f"{len(results['records'])} records; report: {out / 'report.md'}; results: {out / RESULTS_JSON}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m dicache.commands.sweep ...`: the subcommand alone (no other subcommand's imports)."""
    parser = argparse.ArgumentParser(prog="dicache sweep", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except DicacheError as exc:
        print(f"dicache sweep: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
