"""Per-step mask for a long Raw schedule, chosen on the training prompts, judged on the held-out ones.

    python experiments/search_step_mask.py [STEPS] [FRACTION] [CURVE] [DAMPING]     # defaults: 28 0.3 3.0 0.35

Start: the `curved` mask (round(FRACTION·STEPS) computed steps, SCM_CURVE=CURVE) with the recommended family
(Fn 0, static, TaylorSeer 1 in sigma, TS_DAMPING=DAMPING). Hill-climb: move one computed step (not step 0) by ±1 or
±2 and keep the first move that raises the mean PSNR on the first 3 `split: train` prompts by more than 0.05 dB;
stop when none does. Then both masks (TaylorSeer and FoCa at the same damping) run on the 16 held-out prompts.
Prints JSON lines while searching and a markdown table at the end (PSNR in dB against the uncached run, CFG 4.5).
"""

import json
import sys
import time

import torch

from dicache import CacheConfig
from dicache.engine.policies.step_mask import curved_positions
from dicache.models.krea2 import Krea2Pipeline
from dicache.models.krea2.checkpoints import heldout_prompts_file, resolve_model
from dicache.sweep.metrics import psnr
from dicache.sweep.prompts import read_prompts
from dicache.sweep.settings import recommended
from dicache.tuning import PipelineRunner

torch.set_num_threads(1)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 28
fraction = float(sys.argv[2]) if len(sys.argv) > 2 else 0.3
curve = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
damping = float(sys.argv[4]) if len(sys.argv) > 4 else 0.35
computed = round(fraction * steps)
pipe = Krea2Pipeline.from_pretrained(resolve_model(None, None), device="cpu")
runner = PipelineRunner(pipe, steps, 4.5, "raw", 128, 128)


def bins(positions: list[int]) -> tuple[list[int], list[int]]:
    """Computed step indices as alternating runs (SCM_COMPUTE_BINS, SCM_CACHE_BINS), computed first."""
    mask = [i in set(positions) for i in range(steps)]
    runs: list[list[int]] = [[], []]
    i = 0
    while i < steps:
        j = i
        while j < steps and mask[j] == mask[i]:
            j += 1
        runs[0 if mask[i] else 1].append(j - i)
        i = j
    return runs[0], runs[1]


def settings(positions: list[int] | None, forecaster: str = "taylor") -> dict:
    base = {**recommended(fraction), "scm_curve": curve, "taylorseer_damping": damping, "forecaster": forecaster}
    if positions is None:
        return base
    compute, cache = bins(positions)
    return {**base, "scm_preset": "none", "scm_compute_bins": compute, "scm_cache_bins": cache}


def score(options: dict, prompts: list, refs: list) -> tuple[float, float, float]:
    """Mean and worst PSNR, and the compute fraction."""
    config = CacheConfig.defaults().merged({**options, "enable_cache": True})
    values, compute = [], []
    for (prompt, seed), ref in zip(prompts, refs):
        run = runner.run(prompt, seed or 0, config)
        values.append(psnr(run.image, ref.image)[0])
        compute.append(run.blocks_run / ref.blocks_total)
    return sum(values) / len(values), min(values), sum(compute) / len(compute)


train = read_prompts(heldout_prompts_file(None), split="train")[:3]
train_refs = [runner.run(p, s or 0, None) for p, s in train]
positions = curved_positions(steps, computed, curve)
best = score(settings(positions), train, train_refs)
start, started = positions, time.perf_counter()
print(json.dumps({"start": positions, "train_psnr": round(best[0], 2)}), flush=True)
improved = True
while improved:
    improved = False
    for i in range(1, computed):
        for move in (-2, -1, 1, 2):
            candidate = sorted(positions[:i] + [positions[i] + move] + positions[i + 1 :])
            if len(set(candidate)) < computed or candidate[0] != 0 or candidate[-1] >= steps:
                continue
            found = score(settings(candidate), train, train_refs)
            if found[0] > best[0] + 0.05:
                positions, best, improved = candidate, found, True
                print(json.dumps({"positions": positions, "train_psnr": round(best[0], 2)}), flush=True)
                break
        if improved:
            break
print(json.dumps({"searched_s": round(time.perf_counter() - started), "mask": positions, "bins": bins(positions)}))

heldout = read_prompts(heldout_prompts_file(None), split="heldout")[:16]
heldout_refs = [runner.run(p, s or 0, None) for p, s in heldout]
print(f"\n{steps} steps, CFG 4.5, {len(heldout)} held-out prompts; start {start}, searched {positions}\n")
print("| setting | compute | train PSNR (3) | held-out PSNR | worst |")
print("|---|---|---|---|---|")
for label, where in (("curved", None), ("searched mask", positions)):
    for forecaster in ("taylor", "foca"):
        options = settings(where, forecaster)
        on_train = score(options, train, train_refs)
        mean, worst, compute = score(options, heldout, heldout_refs)
        name = f"{label} (curve {curve})" if where is None else f"{label} bins {bins(where)[0]}/{bins(where)[1]}"
        print(f"| {name}, {forecaster} d{damping} | {compute:.3f} | {on_train[0]:.2f} | {mean:.2f} | {worst:.2f} |")
