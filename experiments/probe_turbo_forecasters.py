"""Forecaster variants on one per-step mask of the Turbo student, on the calibration captions (issue 25).

    PYTHONPATH=$PWD python experiments/probe_turbo_forecasters.py '[{}, {"forecaster": "foca"}, {"enable_dmd": true}]'
    PYTHONPATH=$PWD python experiments/probe_turbo_forecasters.py --fit per-channel '[{}]'

Each JSON entry is merged over the mask's candidate (`dicache.tuning.masks.mask_overrides`; default mask: steps
0, 1, 2, 5 of 8; an entry's `mask` key gives another as 0/1 flags; `enable_dmd` drops the TaylorSeer keys). Runs
`dicache.tuning.calibrate` without early stop on the first 4 captions of `turbo_calibration_prompts.json` and prints
compute, mean and worst PSNR against the uncached 8 steps. `--fit per-channel|per-token` replaces the input-corrected
forecaster's inner products by per-channel / per-token ones (a probe of finer fits; not a setting).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dicache.engine.calibrators import input_corrected
from dicache.models.krea2 import Krea2Pipeline
from dicache.models.krea2.checkpoints import resolve_model
from dicache.tuning import PipelineRunner, calibrate
from dicache.tuning.masks import mask_overrides

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "grids" / "turbo_calibration_prompts.json"
DEFAULT_MASK = (1, 1, 1, 0, 0, 1, 0, 0)
TAYLOR_KEYS = ("enable_taylorseer", "taylorseer_order", "taylorseer_distance", "taylorseer_damping", "forecaster")
FITS = {
    "per-channel": lambda a, b: (a * b).sum(dim=tuple(range(a.dim() - 1)), keepdim=True),
    "per-token": lambda a, b: (a * b).sum(dim=-1, keepdim=True),
}


def candidate(variant: dict) -> dict:
    variant = dict(variant)
    out = {**mask_overrides(tuple(variant.pop("mask", DEFAULT_MASK))), **variant}
    if out.get("enable_dmd"):
        for key in TAYLOR_KEYS:
            out.pop(key, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", help="JSON list of override dicts")
    parser.add_argument("--fit", choices=sorted(FITS), help="inner products of the input-corrected fit")
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.fit:
        input_corrected.InputCorrectedCalibrator._dot = staticmethod(FITS[args.fit])
    variants = json.loads(args.variants)
    pipe = Krea2Pipeline.from_pretrained(resolve_model(None, "turbo"), device="cpu")
    runner = PipelineRunner(pipe, 8, 1.0, "turbo", 128, 128)
    samples = [(p["prompt"], p["seed"]) for p in json.loads(PROMPTS.read_text())][: args.prompts]
    result = calibrate(
        runner,
        samples,
        [candidate(v) for v in variants],
        target_psnr=1.0,
        criterion="mean",
        early_stop=False,
        progress=False,
    )
    for r in result.candidates:
        print(f"{r.compute_fraction:.3f}  {r.psnr_mean:.2f}  {r.psnr_min:.2f}  {json.dumps(variants[r.index])}")


if __name__ == "__main__":
    main()
