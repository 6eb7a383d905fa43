"""The fitted output predictor on Raw 28 (CFG 4.5, 128 px), or on the Turbo student (`--variant turbo`: 8 steps, no
CFG): one fit variant on one mask, judged on the training captions' own seeds (what calibrate scores on) and on the
16 held-out prompts. With `--quantization` (e.g. fp8-emulated, in bf16) the predictor is fitted on the quantized model
steering to the unquantized uncached run and judged against that run, as `dicache calibrate --quantization` does.

    python experiments/raw_predictor_probe.py MASK [--fit-seeds 8] [--ridge 1e-3] [--steps 28] [--guidance 4.5]
        MASK: computed steps, e.g. 0,1,2,3,5,9,16,25
    python experiments/raw_predictor_probe.py 0,1,2,3,5,9,15,24 --climb 16 --known build/logs/climb2.log --threads 2
        the hill-climb on the training captions' own seeds (masks in --known logs not refitted), then the best judged
    python experiments/raw_predictor_probe.py 0,1,3,6 --variant turbo --quantization fp8-emulated --fit-seeds 16

Fit samples: the 6 training captions, seeds seed+1 … seed+k (their uncached batch cached under build/raw-probe/).
Every run is one batch (`generate_batch`); the references are the uncached batch of the same samples, so a figure
here can differ from the sweep's per-image runs by a few hundredths of a dB. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dicache.models.krea2.checkpoints import heldout_prompts_file, resolve_model
from dicache.settings.cache_config import CacheConfig
from dicache.sweep.fitting import BatchRun, Trajectory, fit_predictor
from dicache.sweep.metrics import psnr
from dicache.sweep.prompts import make_samples, read_prompts
from dicache.sweep.runners import NativeRunner
from dicache.sweep.spec import Schedule
from dicache.tuning.predictor import predictor_overrides

ROOT = Path("build/raw-probe")


def mask_of(text: str, steps: int) -> tuple[int, ...]:
    on = {int(s) for s in text.split(",")}
    return tuple(1 if i in on else 0 for i in range(steps))


class Probe:
    def __init__(
        self, steps: int = 28, guidance: float = 4.5, size: int = 128, variant: str = "raw", quantization: str = "none"
    ) -> None:
        model = str(resolve_model(None, variant))
        quantized = quantization != "none"
        dtype = torch.bfloat16 if quantized else torch.float32  # a quantized model is judged against bf16
        self.native = NativeRunner.load(model, dtype=dtype)
        served = NativeRunner.load(model, dtype=dtype, quantization=quantization) if quantized else self.native
        self.schedule = Schedule(steps, guidance, variant)
        self.run = BatchRun(served, self.schedule, size, size)  # the model fitted and judged
        self.reference = BatchRun(self.native, self.schedule, size, size)  # its uncached run: trajectory, references
        path = heldout_prompts_file(None)
        self.train = make_samples(read_prompts(path, split="train"), None)
        self.heldout = make_samples(read_prompts(path, split="heldout"), None)[:16]
        self.tag = f"{variant}-n{steps}-cfg{guidance:g}-{size}" + (f"-{quantization}" if quantized else "")
        ROOT.mkdir(parents=True, exist_ok=True)

    def cached(self, name: str, make):
        path = ROOT / f"{self.tag}-{name}.pt"
        if path.is_file():
            return torch.load(path)
        value = make()
        torch.save(value, path)
        return value

    def trajectory(self, seeds: int, first: int = 1) -> tuple[list, Trajectory]:
        samples = [(p, s + k) for p, s in self.train for k in range(first, first + seeds)]

        def make():
            t = Trajectory.record(self.reference, samples)
            return {"x": t.x, "dt": t.dt}

        saved = self.cached(f"traj-{first}-{seeds}", make)
        return samples, Trajectory(x=saved["x"], dt=saved["dt"])

    def images(self, samples, config, run: BatchRun | None = None) -> torch.Tensor:
        latents = (run or self.run)(samples, config)
        size = self.run.height
        return self.native.pipe.decode(latents, size, size, "pt").float()

    def references(self, which: str) -> torch.Tensor:
        samples = self.train if which == "train" else self.heldout
        return self.cached(f"ref-{which}", lambda: self.images(samples, None, self.reference))

    def judge(self, path: Path, mask: tuple[int, ...], which: str) -> list[float]:
        samples = self.train if which == "train" else self.heldout
        config = CacheConfig.from_env({}, **predictor_overrides(mask, str(path)), enable_cache=True)
        return psnr(self.images(samples, config), self.references(which))


class SteeredTrajectory(Trajectory):
    """`Trajectory` with another steering target: `alpha` scales the correction back onto the uncached run
    (1: today's), `aim="gap"` aims each cached step at the uncached latents of the next computed step."""

    def __init__(self, base: Trajectory, mask, alpha: float = 1.0, aim: str = "next") -> None:
        super().__init__(x=base.x, dt=base.dt)
        self.mask, self.alpha, self.aim = mask, alpha, aim

    def target(self, step, x):
        if self.aim == "gap":
            end = next((c for c in range(step + 1, len(self.dt)) if self.mask[c]), len(self.dt))
            span = sum(self.dt[step:end])
            return (self.x[end].float() - x.float()) / span
        on = (self.x[step + 1].float() - self.x[step].float()) / self.dt[step]
        return on + self.alpha * (self.x[step].float() - x.float()) / self.dt[step]


def summary(values: list[float]) -> dict:
    return {"mean": round(sum(values) / len(values), 2), "worst": round(min(values), 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mask")
    parser.add_argument("--fit-seeds", type=int, default=8)
    parser.add_argument("--ridge", type=float, default=1e-3)
    parser.add_argument("--variant", default="raw", choices=["raw", "turbo"], help="turbo: the Turbo student")
    parser.add_argument("--quantization", default="none", help="the fitted and judged model's, e.g. fp8-emulated")
    parser.add_argument("--steps", type=int, default=None, help="default 28 (raw) / 8 (turbo)")
    parser.add_argument("--guidance", type=float, default=None, help="default 4.5 (raw) / 1 (turbo)")
    parser.add_argument("--fit-first", type=int, default=1, help="first fit seed offset (0: the judged train seeds)")
    parser.add_argument("--alpha", type=float, default=1.0, help="steering: the share of the correction")
    parser.add_argument("--aim", default="next", choices=["next", "gap"], help="steer to the next step / gap end")
    parser.add_argument("--weight-floor", default="0.05", help="sample_weights' floor; none: every sample alike")
    parser.add_argument("--label", default="")
    parser.add_argument("--climb", type=int, default=0, help="hill-climb the mask on the train score, this many fits")
    parser.add_argument("--known", nargs="*", default=[], help="climb logs (JSON lines) whose masks are not refitted")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    turbo = args.variant == "turbo"
    args.steps = args.steps if args.steps is not None else (8 if turbo else 28)
    args.guidance = args.guidance if args.guidance is not None else (1.0 if turbo else 4.5)
    probe = Probe(args.steps, args.guidance, variant=args.variant, quantization=args.quantization)
    mask = mask_of(args.mask, args.steps)
    floor = None if args.weight_floor == "none" else float(args.weight_floor)
    started = time.perf_counter()
    samples, trajectory = probe.trajectory(args.fit_seeds, args.fit_first)
    if args.alpha != 1.0 or args.aim != "next":
        trajectory = SteeredTrajectory(trajectory, mask, args.alpha, args.aim)
    if args.climb:
        from dicache.tuning.masks import computed_steps, hill_climb

        def score(candidate):
            fit = fit_predictor(probe.run, samples, predictor_overrides(candidate), trajectory, args.ridge, floor)
            values = probe.judge(fit.save(ROOT / "climb.safetensors"), candidate, "train")
            line = {
                "climb": computed_steps(candidate),
                "train": summary(values),
                "s": round(time.perf_counter() - started),
            }
            print(json.dumps(line), flush=True)
            return sum(values) / len(values)

        known = {}
        for log in args.known:
            for line in Path(log).read_text().splitlines():
                if line.startswith('{"climb"'):
                    entry = json.loads(line)
                    known[mask_of(",".join(map(str, entry["climb"])), args.steps)] = entry["train"]["mean"]
        climbed = hill_climb(mask, score, budget=args.climb, known=known)
        scores = {**known, **dict(climbed)}
        best = max((m for m, v in scores.items() if v is not None), key=lambda m: scores[m])
        mask = best
        print(json.dumps({"climbed": computed_steps(best), "fits": len(climbed)}), flush=True)
    fit = fit_predictor(probe.run, samples, predictor_overrides(mask), trajectory, args.ridge, floor)
    path = fit.save(ROOT / "fit.safetensors")
    fitted_s = time.perf_counter() - started
    train, heldout = probe.judge(path, mask, "train"), probe.judge(path, mask, "heldout")
    print(
        json.dumps(
            {
                "label": args.label,
                "mask": ",".join(str(i) for i, f in enumerate(mask) if f),
                "compute": round(sum(mask) / len(mask), 3),
                "fit_seeds": args.fit_seeds,
                "ridge": args.ridge,
                "weight_floor": floor,
                "train": summary(train),
                "heldout": summary(heldout),
                "fit_s": round(fitted_s),
                "s": round(time.perf_counter() - started),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()


def step_errors(probe: Probe, samples, config) -> list[float]:
    """Per step: the relative error of the latents entering it against the uncached run's (batch `samples`)."""
    inputs: list[torch.Tensor] = []
    per_step = 2 if probe.schedule.cfg else 1

    def keep(module, args, kwargs):
        inputs.append(kwargs.get("hidden_states", args[0] if args else None).detach().clone())

    handle = probe.native.pipe.transformer.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        final = probe.run(samples, config)
    finally:
        handle.remove()
    return [inputs[i] for i in range(0, len(inputs), per_step)] + [final]
