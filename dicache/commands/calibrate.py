"""`dicache calibrate`: measure cache-setting candidates on a model and write the cheapest one that meets a PSNR
target (vs the uncached run) as a settings profile for `--profile` / `SGLANG_CACHE_DIT_PROFILE`.

The procedure and the choice rule are in `dicache.tuning`. Exit status 0: the profile was written; 2: bad input,
or no candidate met the target (the table is printed, nothing is written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import torch

from .. import __version__
from ..engine.cached_step import DEFAULT_RIDGE
from ..models.families import is_family_model, pipeline_class
from ..models.krea2 import Krea2Pipeline
from ..models.krea2.checkpoints import heldout_prompts_file, resolve_model
from ..models.krea2.presets import PRESETS, resolve_variant
from ..models.options import DeviceOptions, QuantizationOptions
from ..quantization import check_fp8_support, parse_quantization
from ..settings.cache_config import SETTINGS, CacheConfig
from ..settings.devices import resolve_device
from ..settings.options import FlagOptions, option
from ..settings.profiles import write_profile
from ..sweep.fitting import DEFAULT_FIT_SEEDS
from ..sweep.prompts import FALLBACK_PROMPTS, make_samples, read_prompts
from ..sweep.runners import FamilyRunner
from ..sweep.settings import RECOMMENDED_BUDGETS
from ..sweep.spec import CACHEDIT_GRID
from ..tuning import (
    CANDIDATES,
    CalibrationError,
    PipelineRunner,
    TargetNotMet,
    budget_grid,
    calibrate,
    calibration_record,
    fit_algorithms,
    format_table,
    load_candidates,
    profile_settings,
)
from ..tuning.masks import MAX_MASK_STEPS
from ..tuning.predictor import CLIMB_FITS, PredictorSearch, parse_mask, prompt_shortage
from .fields import add_options
from .generate import add_sampling_arguments
from .shared import RunOptions

HELP = (
    "find the least-compute cache settings whose PSNR vs uncached meets a target on a few prompts, and write them "
    "as a settings profile (for --profile / SGLANG_CACHE_DIT_PROFILE)"
)
DEFAULT_PROMPTS = 4
DEFAULT_OUT = "dicache-profile.json"


def parse_size(text: str) -> tuple[int, int]:
    """`--size`: 'N' -> (N, N); 'WxH' -> (W, H), in px; ValueError otherwise."""
    try:
        parts = [int(p) for p in text.lower().replace("×", "x").split("x")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or min(parts) < 1:
        raise ValueError(f"expected N or WIDTHxHEIGHT in px, e.g. 128 or 128x96, got {text!r}")
    return parts[0], parts[1]


class CalibrateOptions(FlagOptions):
    """What `dicache calibrate` measures, against which target, and where it writes the profile (the model and
    schedule are `ModelChoice` and `SamplingOptions`, the device `DeviceOptions`)."""

    size: str | None = option(
        None, flag="--size", read=parse_size, default_text="the checkpoint's", help="image size: N (square) or WxH px"
    )
    prompts: str = option(
        str(DEFAULT_PROMPTS),
        flag="--prompts",
        metavar="N|FILE",
        help="a count of the checkpoint's held-out prompts (with their seeds), or a prompt file: text (one a line, "
        "seed 0) or JSON (strings or {prompt, seed} objects)",
    )
    target_psnr: float = option(35.0, flag="--target-psnr", help="PSNR in dB vs the uncached image")
    criterion: Literal["min", "mean"] = option(
        "min", flag="--criterion", help="min: every prompt must meet the target (safe); mean: their average must"
    )
    candidates: str | None = option(
        None,
        flag="--candidates",
        metavar="FILE",
        help="JSON/YAML list of override dicts to try (default: the built-in list, see --list-candidates)",
    )
    list_candidates: bool = option(False, flag="--list-candidates", help="print the built-in candidates as JSON; exit")
    out: str = option(DEFAULT_OUT, flag="--out", help="profile to write (replaced)")
    no_step_masks: bool = option(
        False,
        flag="--no-step-masks",
        help=f"skip the per-step mask search (on schedules of at most {MAX_MASK_STEPS} steps, each mask scored is a "
        "candidate: which steps to compute, the cached ones forecast with forecaster=input_corrected)",
    )
    fit_seeds: int = option(
        DEFAULT_FIT_SEEDS,
        flag="--fit-seeds",
        ge=0,
        help="with the step mask search, also search masks whose cached steps a fitted output predictor answers "
        "(cached_step_method=fitted), fitted on each prompt with this many other seeds (seed+1...); 0: off. The "
        "predictor files go next to OUT (<out>.predictors/); the chosen one stays",
    )
    mask_climb: int = option(
        CLIMB_FITS,
        flag="--mask-climb",
        ge=0,
        help="the fitted predictor's masks: at most this many more fits after the first ones. On schedules of more "
        f"than {MAX_MASK_STEPS} steps a hill-climb (one computed step moved by ±1/±2 at a time) from the best curved "
        "masks of --budgets, cheapest budget first, until one meets the target; on shorter ones, after the beam "
        "search, the size below the cheapest one meeting the target: each of its masks not scored yet when they "
        "fit, else the same climb; 0: none",
    )
    fit_masks: list[str] | None = option(
        None,
        flag="--fit-masks",
        metavar="STEPS",
        help="the fitted predictor's first masks, each the computed steps comma-separated (e.g. 0,1,2,3,5,9,16,25): "
        f"on schedules of more than {MAX_MASK_STEPS} steps instead of the curved masks of --budgets (the climb "
        "starts from the best of them); on shorter ones scored before the beam search, which may not reach them",
    )
    fit_ridge: float = option(
        DEFAULT_RIDGE,
        flag="--fit-ridge",
        gt=0.0,
        help="the fitted predictor's ridge λ, relative to the mean diagonal of the features' Gram matrix (smaller: "
        "closer fit; choose it on training prompts, e.g. leaving one out)",
    )
    fit_leave_prompt_out: bool = option(
        False,
        flag="--fit-leave-prompt-out",
        help="score each fitted predictor's mask on every prompt with a fit made without that prompt alone (one fit "
        "per prompt and mask) instead of the default two folds of the prompts (two fits per mask); either way each "
        "prompt is scored by a fit that never saw it, and the chosen candidate gets the fit on all prompts",
    )
    no_early_stop: bool = option(
        False, flag="--no-early-stop", help="run every candidate on every prompt (fuller table, slower)"
    )
    prompt_split: Literal["heldout", "train"] = option(
        "heldout",
        flag="--prompt-split",
        help="the split of the checkpoint's heldout_prompts.json a count of --prompts takes: train = its training "
        "captions (settings chosen apart from the held-out prompts a sweep then measures)",
    )
    grid_out: str | None = option(
        None,
        flag="--grid-out",
        metavar="PATH",
        help="also write a `dicache sweep --grid` JSON file: per --budgets bin the candidate with the best PSNR on "
        "these prompts (with --no-early-stop every candidate runs on every prompt), plus cache-dit's own grid; "
        "written whether or not the target is met",
    )
    budgets: list[float] | None = option(
        None,
        flag="--budgets",
        metavar="F",
        default_text="0.3 0.4 ... 0.8",
        help="compute bins of --grid-out (each f: compute in [f - 0.05, f + 0.05)), and on schedules of more than "
        f"{MAX_MASK_STEPS} steps the budgets whose curved masks the fitted predictor tries",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  dicache calibrate --out turbo.json --variant turbo                 # embedded model, 4 held-out prompts\n"
        "  dicache calibrate --steps 28 --guidance 4.5 --target-psnr 40 --out raw28.json\n"
        "  dicache calibrate --model DIR --device cuda --prompts prompts.txt --candidates mine.yaml\n"
        "  dicache calibrate --variant turbo --prompts benchmarks/grids/turbo_calibration_prompts.json --fit-seeds 8\n"
        "  dicache generate 'red apple' --profile turbo.json        # or SGLANG_CACHE_DIT_PROFILE=turbo.json\n"
        "The profile holds the chosen settings (caching on) and how they were measured; calibrate with the steps,\n"
        "guidance and size you will serve: the target is only checked there. SGLANG_CACHE_DIT_* variables still\n"
        "override a profile's values when it is used; calibration itself ignores them (built-in defaults + candidate)."
    )
    add_sampling_arguments(parser, "--preset")
    add_options(parser, CalibrateOptions)
    add_options(parser, QuantizationOptions)
    add_options(parser, DeviceOptions)
    add_options(parser, RunOptions)


def _heldout_file(model: str | None) -> Path:
    return heldout_prompts_file(model)


def resolve_samples(prompts: str, model: str | None, split: str = "heldout") -> list[tuple[str, int]]:
    """(prompt, seed) pairs of `--prompts`: a count of the checkpoint's prompts of `split` (built-in ones when it
    has none), or a prompt file."""
    text = prompts.strip()
    if text.isdigit():
        count = int(text)
        if count < 1:
            raise CalibrationError(f"--prompts={prompts!r} is invalid: a count must be >= 1 (or give a prompt file)")
        path = _heldout_file(model)
        pairs = read_prompts(path, split=split) if path.is_file() else [(p, None) for p in FALLBACK_PROMPTS]
        return make_samples(pairs, None, count)
    if not Path(text).is_file():
        raise CalibrationError(f"--prompts={prompts!r} is neither a count nor an existing prompt file")
    return make_samples(read_prompts(text, split="heldout"), None)


def _env_knobs() -> list[str]:
    return [k.env_name for k in SETTINGS if k.env_name in os.environ and k.key != "enable_cache"]


def run(args: argparse.Namespace) -> int:
    if args.list_candidates:
        print(json.dumps(list(CANDIDATES), indent=2))
        return 0
    candidates = load_candidates(args.candidates) if args.candidates else list(CANDIDATES)
    samples = resolve_samples(args.prompts, args.model, getattr(args, "prompt_split", "heldout"))
    prompts = len({p for p, _ in samples})
    if getattr(args, "fit_leave_prompt_out", False) and prompts < 2:
        raise CalibrationError(
            f"--fit-leave-prompt-out needs 2 or more distinct prompts (--prompts {args.prompts!r} gives {prompts}): "
            "each is scored by a fit on the others"
        )

    previous_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        runner, reference, meta = _load_runner(args)
        print(
            f"calibrating {meta['model_source']}: {meta['steps']} steps, guidance {meta['guidance_scale']:g}, "
            f"{meta['width']}x{meta['height']} px, {len(samples)} prompt(s), {len(candidates)} candidate(s), "
            f"target {args.criterion} PSNR >= {args.target_psnr:g} dB",
            flush=True,
        )
        fits = fit_algorithms(runner, *samples[0])
        print(
            f"fitted on {samples[0][0]!r}: teacache_coefficients "
            f"{[round(c, 4) for c in fits['teacache_coefficients']]}, magcache_ratios {fits['magcache_ratios']}",
            flush=True,
        )
        result = calibrate(
            runner,
            samples,
            candidates,
            target_psnr=args.target_psnr,
            criterion=args.criterion,
            early_stop=not args.no_early_stop,
            progress=not args.no_progress,
            step_masks=not args.no_step_masks,
            predictor=_predictor_search(runner, samples, args, reference),
            reference=reference,
            on_reject=lambda r: print(f"skipping candidate #{r.index} {r.label}: {r.error}", file=sys.stderr),
            base=CacheConfig.defaults().merged(fits),
        )
    finally:
        torch.set_num_threads(previous_threads)

    print(format_table(result))
    measured_on = getattr(runner.native, "measured_on", None)  # a family's pipeline: images, or latents if flat
    if measured_on is not None:
        meta["measured_on"] = measured_on
        where = "decoded images" if measured_on == "image" else "final latents (the decoded images are flat)"
        print(f"fidelity measured on the {where}")
    kept: set[Path] = set()  # predictor files the grid names
    if getattr(args, "grid_out", None):
        grid, lines = budget_grid(result, args.budgets or list(RECOMMENDED_BUDGETS), CACHEDIT_GRID)
        path = Path(args.grid_out)
        kept = _grid_predictors_relative(grid, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(grid, indent=2) + "\n")
        print("\n".join(lines))
        print(f"wrote {path}: dicache sweep --grid {path} measures these settings (on other prompts)")
    if result.chosen is None:
        _keep_chosen_predictor({}, args.out, kept)  # no profile is written: only the grid's predictor files stay
        raise TargetNotMet(result.failure_message())

    if getattr(args, "fit_seeds", 0) and not args.no_step_masks:  # how the fitted predictors were fitted and scored
        meta["predictor_fit"] = {
            "seeds": args.fit_seeds,
            "ridge": getattr(args, "fit_ridge", DEFAULT_RIDGE),
            "leave_prompt_out": getattr(args, "fit_leave_prompt_out", False),
        }
    record = calibration_record(
        result,
        **meta,
        fitted_on={"prompt": samples[0][0], "seed": samples[0][1]},
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        dicache_version=__version__,
        torch_version=torch.__version__,
    )
    settings = profile_settings(result.chosen)
    _keep_chosen_predictor(settings, args.out, kept)
    path = write_profile(args.out, settings, record)
    print(f"wrote {path}: use it with --profile {path} (dicache generate / serve / config) or SGLANG_CACHE_DIT_PROFILE")
    if result.chosen.compute_fraction >= 1.0:
        print(
            "note: the chosen settings cache nothing at this schedule (compute 1.000): no candidate that saves compute "
            "meets the target; try a lower --target-psnr, more steps, or other --candidates"
        )
    shadowed = _env_knobs()
    if shadowed:
        print(f"note: {', '.join(shadowed)} set in this environment would override the profile's values")
    return 0


def predictor_folder(out: str) -> Path:
    """Where the fitted predictors of a calibration writing the profile `out` go: `<out without suffix>.predictors`."""
    path = Path(out)
    return path.with_name(path.stem + ".predictors")


def _predictor_search(
    runner: Any, samples: list[tuple[str, int]], args: argparse.Namespace, reference: Any = None
) -> Any:
    if args.fit_seeds == 0 or args.no_step_masks:
        return None
    refusal = runner.fitted_refusal()
    if refusal is not None:  # e.g. a family whose scheduler is not a flow-matching Euler one
        print(f"skipping the fitted predictor's masks: {refusal}", file=sys.stderr)
        return None
    shortage = prompt_shortage(samples)
    if shortage is not None:
        print(f"note: the fitted predictor is not searched: {shortage}", file=sys.stderr)
        return None
    ridge = getattr(args, "fit_ridge", DEFAULT_RIDGE)  # absent from a namespace built without CalibrateOptions
    leave_out = getattr(args, "fit_leave_prompt_out", False)
    budgets = getattr(args, "budgets", None) or RECOMMENDED_BUDGETS
    climb = getattr(args, "mask_climb", CLIMB_FITS)
    fit_masks = getattr(args, "fit_masks", None) or []
    starts = [parse_mask(text, runner.steps) for text in fit_masks]
    return PredictorSearch(
        runner,
        samples,
        args.fit_seeds,
        predictor_folder(args.out),
        ridge=ridge,
        reference=reference,
        leave_prompt_out=leave_out,
        budgets=budgets,
        climb=climb,
        starts=starts,
    )


def _grid_predictors_relative(grid: dict[str, Any], path: Path) -> set[Path]:
    """The predictor files `grid`'s cells name, each rewritten relative to the grid file at `path` (how
    `dicache sweep --grid` reads it, as a profile names its own); returns them resolved."""
    named = set()
    for cell in grid.get("grid", []):
        files = cell.get("fitted_predictor") or []
        named.update(Path(f).resolve() for f in files)
        cell_files = [os.path.relpath(Path(f).resolve(), path.resolve().parent) for f in files]
        if cell_files:
            cell["fitted_predictor"] = cell_files
    return named


def _keep_chosen_predictor(settings: dict[str, Any], out: str, keep: set[Path] = frozenset()) -> None:
    """The chosen profile's predictor file, named relative to the profile (as the profile reads it); the other
    fits' files are removed, but for those in `keep` (resolved paths: the ones a `--grid-out` grid names)."""
    folder = predictor_folder(out)
    chosen = settings.get("fitted_predictor")
    kept = set(keep)
    if chosen is not None:
        chosen_path = Path(chosen).resolve()
        kept.add(chosen_path)
        settings["fitted_predictor"] = os.path.relpath(chosen_path, Path(out).resolve().parent)
    if folder.is_dir():
        for file in folder.glob("mask-*.safetensors"):
            if file.resolve() not in kept:
                file.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()


def _load_family_runner(args: argparse.Namespace, device: str, dtype: Any) -> tuple[Any, Any, dict[str, Any]]:
    """`_load_runner` for a diffusers pipeline of a registered family (its own `__call__`: `FamilyRunner`)."""
    embedded = getattr(args, "embedded_guidance", None)
    name = f"{pipeline_class(args.model)} ({args.model})"
    if args.variant is not None:
        raise CalibrationError(f"--variant={args.variant!r} is refused for {name}: variants are Krea-2's presets")
    quantization = getattr(args, "quantization", None)  # absent from a namespace built without QuantizationOptions
    if parse_quantization(quantization, getattr(args, "quantization_exclude", None)) is not None:
        raise CalibrationError(
            f"--quantization={quantization!r} is refused for {name}: calibrating the quantized model against "
            "the unquantized one is built for Krea-2 checkpoints"
        )
    family = FamilyRunner.load(args.model, dtype=dtype or torch.float32, device=device)
    sampling = family.model.sampling
    steps = args.steps or sampling["steps"]
    guidance = float(args.guidance if args.guidance is not None else sampling["guidance"])
    height, width = family.default_size
    if args.size:
        width, height = args.size
    runner = PipelineRunner(family, steps, guidance, None, height, width, embedded_guidance=embedded)
    meta = {
        "model": args.model,
        "model_source": f"{family.model.name} from {args.model}",
        "num_blocks": runner.num_blocks,
        "variant": None,
        "steps": steps,
        "guidance_scale": guidance,
        "embedded_guidance": embedded,
        "width": width,
        "height": height,
        "device": str(device),
        "dtype": str(next(family.pipe.transformer.parameters()).dtype).removeprefix("torch."),
    }
    return runner, None, meta


def _load_runner(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """The pipeline runner at the resolved schedule and size, the reference runner (the unquantized model when
    `--quantization` is given, else None: the runner itself) and what to record about them."""
    device = str(resolve_device(args.device))
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if is_family_model(args.model):
        return _load_family_runner(args, device, dtype)
    embedded = getattr(args, "embedded_guidance", None)  # absent from a namespace built without SamplingOptions
    if embedded is not None:
        raise CalibrationError(f"--embedded-guidance={embedded:g} is refused for Krea-2: it has none")
    # a bad value stops before loading; absent from a namespace built without QuantizationOptions
    spec = parse_quantization(getattr(args, "quantization", None), getattr(args, "quantization_exclude", None))
    if spec is not None and spec.method == "fp8":
        check_fp8_support(device)

    source = resolve_model(args.model, args.variant)
    pipe = Krea2Pipeline.from_pretrained(source, dtype=dtype, device=device, quantization=spec)
    variant = resolve_variant(pipe, args.variant)
    preset = PRESETS[variant]
    steps = args.steps if args.steps is not None else preset.num_inference_steps
    guidance = float(args.guidance if args.guidance is not None else preset.guidance_scale)
    width, height = args.size if args.size else (pipe.default_size[1], pipe.default_size[0])
    multiple = pipe.size_multiple
    if width % multiple or height % multiple:
        raise CalibrationError(f"--size={width}x{height} is invalid: each side must be a multiple of {multiple} px")
    runner = PipelineRunner(pipe, steps, guidance, variant, height, width)
    reference = None
    if spec is not None:  # the served model is calibrated against the unquantized one
        unquantized = Krea2Pipeline.from_pretrained(source, dtype=dtype, device=device)
        reference = PipelineRunner(unquantized, steps, guidance, variant, height, width)
    meta = {
        "model": args.model,
        "model_source": pipe.source,
        "num_blocks": runner.num_blocks,
        "variant": variant,
        "steps": steps,
        "guidance_scale": guidance,
        "width": width,
        "height": height,
        "device": str(pipe.device),
        "dtype": str(next(pipe.transformer.parameters()).dtype).removeprefix("torch."),
        "quantization": None if spec is None else {"method": spec.method, "exclude": list(spec.exclude)},
    }
    return runner, reference, meta
