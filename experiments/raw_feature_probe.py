"""Which features the fitted predictor could use on Raw 28 (CFG 4.5): a teacher-forced one-step probe.

    python experiments/raw_feature_probe.py [MASK]          # default 0,1,2,3,5,9,16,25

Every run is forced onto the uncached trajectory (after each step the latents are replaced by the uncached run's), so
each cached step's features come from the true history and the step's input; the features of each set are fitted (one
ridge solve per cached step, both CFG branches together on the guided velocity) on the training captions' other seeds
(seed+1 … seed+8) and judged on the captions' own seeds: per set, the relative error of the guided velocity summed
over the cached steps as the latent error it makes, `Σ (dt · ‖err‖)² / Σ ‖x‖²`, in dB (higher is better). A proxy for
the rollout: features that carry the previous step's true velocity (the previous input) are left out (they leak).
`ts`: the forward's output under TaylorSeer (order 1 in sigma, damping 0.35) on that step: the stack's residual
forecast, the embeddings and the final layer run at the step's timestep.
"""

from __future__ import annotations

import json
import math
import sys

import torch
from raw_predictor_probe import Probe, mask_of  # noqa: E402  (run from experiments/ or with it on sys.path)

from dicache.engine.cached_step import solve_ridge
from dicache.settings.cache_config import CacheConfig
from dicache.tuning.masks import mask_bins


def record(probe: Probe, samples, config, forced=None):
    """Outputs `{(step, branch): (B, N, C)}` and inputs `{step: (B, N, C)}` of one batched run; `forced`: the
    latents `{step: (B, N, C)}` each step's result is replaced with."""
    pipe, schedule, size = probe.native.pipe, probe.schedule, probe.run.height
    outs, xs, calls = {}, {}, []

    def keep(module, args, kwargs, output):
        x = kwargs.get("hidden_states", args[0] if args else None)
        calls.append((x.detach().clone(), output.detach().clone()))

    def force(p, i, t, tensors):
        return {"latents": forced[i + 1].clone()} if forced is not None and i + 1 in forced else tensors

    plan = pipe.plan_call(1, size, size, schedule.steps, schedule.guidance_scale, variant=schedule.variant)
    latents = torch.cat([pipe.starting_latents(plan, seed) for _, seed in samples])
    probe.native.configure(config)
    handle = pipe.transformer.register_forward_hook(keep, with_kwargs=True)
    try:
        pipe(
            [p for p, _ in samples],
            height=size,
            width=size,
            num_inference_steps=schedule.steps,
            guidance_scale=schedule.guidance_scale,
            latents=latents,
            output_type="latent",
            variant=schedule.variant,
            callback_on_step_end=force,
        )
    finally:
        handle.remove()
    for index, (x, out) in enumerate(calls):
        step, branch = divmod(index, 2)
        outs[(step, branch)] = out
        xs[step] = x
    return outs, xs


def blur(t: torch.Tensor) -> torch.Tensor:
    """A 3 × 3 mean over the square token grid `(B, N, C)` (edges: the mean of the tokens inside)."""
    b, n, c = t.shape
    side = int(round(n**0.5))
    grid = t.float().transpose(1, 2).reshape(b, c, side, side)
    pooled = torch.nn.functional.avg_pool2d(grid, 3, 1, 1, count_include_pad=False)
    return pooled.reshape(b, c, n).transpose(1, 2)


FEATURE_SETS = {
    "base": lambda v, x, x0, xs1, ts: [v[0], v[1], v[2], x, x0],
    "base+v3": lambda v, x, x0, xs1, ts: [v[0], v[1], v[2], v[3], x, x0],
    "base+ts": lambda v, x, x0, xs1, ts: [v[0], v[1], v[2], x, x0, ts],
    "ts-only": lambda v, x, x0, xs1, ts: [ts],
    "v0v1+x": lambda v, x, x0, xs1, ts: [v[0], v[1], x, x0],
    "base+x1": lambda v, x, x0, xs1, ts: [v[0], v[1], v[2], x, x0, xs1],
    "base+x^2": lambda v, x, x0, xs1, ts: [v[0], v[1], v[2], x, x0, x * x],
    "base+blur(x)": lambda v, x, x0, xs1, ts: [v[0], v[1], v[2], x, x0, blur(x)],
    "base+blur(v0)": lambda v, x, x0, xs1, ts: [v[0], v[1], v[2], x, x0, blur(v[0])],
    "base+blur(x,v0)": lambda v, x, x0, xs1, ts: [v[0], v[1], v[2], x, x0, blur(x), blur(v[0])],
}


def features(name: str, step: int, branch: int, mask, outs, xs, ts) -> torch.Tensor:
    computed = [c for c in range(step) if mask[c]][::-1]
    hist = [computed[min(k, len(computed) - 1)] for k in range(4)]
    x, x0 = xs[step], xs[hist[0]]
    one = torch.ones(*x.shape[:-1], 1)
    v = [outs[(c, branch)] for c in hist]
    if name.endswith("@cond"):  # the cond branch's features only: the uncond branch keeps the base ones
        name = name.removesuffix("@cond") if branch == 0 else "base"
    parts = FEATURE_SETS[name.removeprefix("guided:")](v, x, x0, xs[hist[1]], ts.get((step, branch), v[0]))
    return torch.cat([p.float() for p in parts] + [one], dim=-1)


def main() -> None:
    torch.set_num_threads(1)
    mask = mask_of(sys.argv[1] if len(sys.argv) > 1 else "0,1,2,3,5,9,16,25", 28)
    probe = Probe()
    s = probe.schedule.guidance_scale
    fit_samples, trajectory = probe.trajectory(8)
    sets = {}
    for which, samples in (("fit", fit_samples), ("eval", probe.train)):
        flags = "".join(map(str, mask))
        sets[which] = probe.cached(f"forced-{which}-{flags}", lambda samples=samples: forced_runs(probe, samples, mask))
    dt = trajectory.dt
    names = sys.argv[2].split(";") if len(sys.argv) > 2 else list(FEATURE_SETS)
    for name in names:
        err2, norm2, per_step = 0.0, 0.0, {}
        for step in range(28):
            if mask[step]:
                continue
            f, y = joint(sets["fit"], name, step, mask, s)
            w = solve_ridge([f], [y], 1e-3)
            fe, ye = joint(sets["eval"], name, step, mask, s)
            err = fe @ w - ye
            xs_eval = sets["eval"][1]
            err2 += float((dt[step] * err).pow(2).sum())
            norm2 += float(xs_eval[min(step + 1, 27)].pow(2).sum())
            per_step[step] = round(float(err.norm() / ye.norm()), 4)
        print(
            json.dumps({name: {"proxy_db": round(-10 * math.log10(err2 / norm2), 2), "rel_err": per_step}}), flush=True
        )


def joint(recorded, name, step, mask, s):
    """Both branches' features side by side (scaled as the guided velocity combines them) and the guided target."""
    outs, xs, ts = recorded
    fc = features(name, step, 0, mask, outs, xs, ts)
    fu = features(name, step, 1, mask, outs, xs, ts)
    target = s * outs[(step, 0)] - (s - 1) * outs[(step, 1)]
    if name.startswith("guided:"):  # one map of the guided features (x and 1 count once: s + 1 - s = 1)
        return s * fc + (1 - s) * fu, target
    return torch.cat([s * fc, (1 - s) * fu], dim=-1), target


def forced_runs(probe, samples, mask):
    """The uncached run's outputs and inputs, and TaylorSeer's outputs forced onto it."""
    compute, cache = mask_bins(mask)
    outs, xs = record(probe, samples, None)
    config = CacheConfig.from_env(
        {},
        enable_cache=True,
        scm_compute_bins=compute,
        scm_cache_bins=cache,
        scm_policy="static",
        max_warmup_steps=0,
        Fn_compute_blocks=0,
        enable_taylorseer=True,
        taylorseer_order=1,
        taylorseer_distance="sigma",
        taylorseer_damping=0.35,
    )
    ts, _ = record(probe, samples, config, forced=xs)
    return outs, xs, ts


if __name__ == "__main__":
    main()
