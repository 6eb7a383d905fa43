"""Fit TeaCache's rescale polynomial and MagCache's ratio profile on a training prompt of the embedded checkpoint,
per schedule, as `dicache calibrate` does (`dicache.tuning.fits`), and print them as JSON (for the sweep grids).

    python experiments/fit_algorithms.py --schedules 28:4.5 50:4.5 [--model DIR] [--size 128]

The prompt is the first `split: train` entry of the checkpoint's heldout_prompts.json (never a held-out prompt).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["28:4.5", "50:4.5"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()

    from dicache.models.krea2 import Krea2Pipeline
    from dicache.models.krea2.checkpoints import heldout_prompts_file, resolve_model
    from dicache.models.krea2.presets import resolve_variant
    from dicache.sweep.prompts import read_prompts
    from dicache.tuning import PipelineRunner, fit_algorithms

    pipe = Krea2Pipeline.from_pretrained(resolve_model(args.model, None), device="cpu")
    prompt, seed = read_prompts(heldout_prompts_file(args.model), split="train")[0]
    out = {"prompt": prompt, "seed": seed or 0, "fits": {}}
    for schedule in args.schedules:
        steps, _, guidance = schedule.partition(":")
        variant = resolve_variant(pipe, None)
        runner = PipelineRunner(pipe, int(steps), float(guidance or 1.0), variant, args.size, args.size)
        start = time.perf_counter()
        with torch.no_grad():
            out["fits"][schedule] = fit_algorithms(runner, prompt, seed or 0)
        out["fits"][schedule]["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
