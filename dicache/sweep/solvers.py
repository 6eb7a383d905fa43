"""Same-compute baseline samplers: fewer-steps Euler, fewer-steps Heun and the `curved` static step-reuse schedule.

These are what a cache must beat (docs/architecture.md §8), so they use no dicache hooks: they run the uncached
transformer over a pipeline's public pieces (`encode_prompt`, `text_conditioning`, `initial_latents`, `sigmas`,
`scheduler.model_timesteps`, `transformer`, `scheduler.step`, `decode`).

Contract
- Integrators take `velocity(x, j)`, the model's velocity at `sigmas[j]`, and `sigmas` from noise down to the
  final value (N + 1 values for N steps); `step(v, x, sigma, sigma_next)` advances `x` (default: the Euler update
  `x + (sigma_next − sigma)·v`). Each returns `(x at sigmas[-1], evaluations)`, evaluations = calls of `velocity`.
- `euler`: N evaluations.
- `heun`: predictor `x̃ = step(v0, x, σ_i, σ_{i+1})` with `v0 = velocity(x, i)`, corrector
  `step((v0 + v1)/2, x, σ_i, σ_{i+1})` with `v1 = velocity(x̃, i+1)`; a step to σ = 0 is a plain Euler step (the model
  is never evaluated at σ = 0). 2N − 1 evaluations for a schedule ending at 0. Second order: exact on a velocity
  linear in σ (away from the last step), global error O(h²).
- `reuse`: velocities are evaluated only at the `computed` steps (step 0 among them); any other step takes an Euler
  step with the last evaluated velocity. len(computed) evaluations.
- `curved_steps(n, k)`: the `curved` schedule's computed steps `round((j/(k−1))^1.5·(n−1))`, j = 0..k−1, deduplicated
  (dense where the noise is high).
- With CFG an evaluation is the guided velocity `cond + (s − 1)·(cond − uncond)` (one forward per branch); reusing it
  is reusing each branch's last velocity, guidance being linear.
- Compute fraction of a baseline = evaluations / n, the uncached n-step run having n evaluations (n·branches forwards
  against evaluations·branches). `counts_for(kind, n, fraction)` picks the solver counts for a target fraction: the
  largest with compute ≤ the target and the smallest with compute ≥ it (so the nearest is always one of them).
- `sample(pipe, ...)` runs one baseline on a `Krea2Pipeline`: the same prompt encoding, noise (CPU generator seeded
  with `seed`), resolution-aware sigmas for the reduced step count (`pipe.sigmas`) and guidance as the pipeline's own
  `__call__`; `euler` there reproduces `pipe(...)` bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..models.krea2.pipeline import guided_velocity, resolve_variant

SOLVERS = ("euler", "heun", "curved")
"""Baseline kinds: `euler` / `heun` with fewer steps, `curved` = n steps computing only `curved_steps(n, k)`."""
CURVED_GAMMA = 1.5

Velocity = Callable[[torch.Tensor, int], torch.Tensor]
Stepper = Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]


def euler_update(velocity: torch.Tensor, x: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """`x + (sigma_next − sigma)·velocity`."""
    return x + (sigma_next - sigma) * velocity


# ---------------------------------------------------------------------------------------------------- integrators
def euler(velocity: Velocity, x: torch.Tensor, sigmas: Sequence[float], step: Stepper = euler_update):
    """Euler over `sigmas`: one evaluation per step. Returns `(x, evaluations)`."""
    for i in range(len(sigmas) - 1):
        x = step(velocity(x, i), x, sigmas[i], sigmas[i + 1])
    return x, len(sigmas) - 1


def heun(velocity: Velocity, x: torch.Tensor, sigmas: Sequence[float], step: Stepper = euler_update):
    """Heun (explicit trapezoid) over `sigmas`; a step to σ = 0 is a plain Euler step. Returns `(x, evaluations)`."""
    evaluations = 0
    for i in range(len(sigmas) - 1):
        v0 = velocity(x, i)
        evaluations += 1
        if sigmas[i + 1] == 0:
            x = step(v0, x, sigmas[i], sigmas[i + 1])
            continue
        predicted = step(v0, x, sigmas[i], sigmas[i + 1])
        v1 = velocity(predicted, i + 1)
        evaluations += 1
        x = step((v0 + v1) / 2, x, sigmas[i], sigmas[i + 1])
    return x, evaluations


def reuse(
    velocity: Velocity, x: torch.Tensor, sigmas: Sequence[float], computed: Sequence[int], step: Stepper = euler_update
):
    """Euler over `sigmas`, evaluating the velocity only at the `computed` steps and reusing the last evaluated one
    elsewhere; step 0 must be computed. Returns `(x, evaluations)`."""
    todo = set(computed)
    if 0 not in todo:
        raise ValueError(f"computed steps {sorted(todo)} must include step 0 (nothing to reuse before it)")
    last = None
    for i in range(len(sigmas) - 1):
        if i in todo:
            last = velocity(x, i)
        x = step(last, x, sigmas[i], sigmas[i + 1])
    return x, len(todo & set(range(len(sigmas) - 1)))


# ---------------------------------------------------------------------------------------------------- schedules
def curved_steps(n: int, k: int, gamma: float = CURVED_GAMMA) -> list[int]:
    """Computed steps of the `curved` schedule: `round((j/(k−1))^gamma·(n−1))` for j = 0..k−1, deduplicated and
    sorted; k = 1 computes step 0 only, k ≥ n every step."""
    if n < 1 or k < 1:
        raise ValueError(f"curved schedule needs n >= 1 and k >= 1, got n={n}, k={k}")
    if k >= n:
        return list(range(n))
    if k == 1:
        return [0]
    return sorted({round((j / (k - 1)) ** gamma * (n - 1)) for j in range(k)})


def evaluations(kind: str, n: int, count: int) -> int:
    """Velocity evaluations (per branch) of a `kind` baseline with solver count `count` for an n-step schedule:
    euler `count` steps; heun `count` steps (2·count − 1); curved `curved_steps(n, count)` computed steps."""
    if kind == "euler":
        return count
    if kind == "heun":
        return 2 * count - 1
    if kind == "curved":
        return len(curved_steps(n, count))
    raise ValueError(f"baseline {kind!r} is unknown; allowed: {', '.join(SOLVERS)}")


def compute_fraction(kind: str, n: int, count: int) -> float:
    """evaluations / n: the baseline's compute against the uncached n-step run."""
    return evaluations(kind, n, count) / n


def options(kind: str, n: int) -> dict[int, int]:
    """Distinct evaluation counts a `kind` baseline can reach on an n-step schedule (up to n evaluations), each with
    the smallest solver count reaching it: {evaluations: count}."""
    out: dict[int, int] = {}
    limit = n if kind != "heun" else (n + 1) // 2
    for count in range(1, limit + 1):
        evals = evaluations(kind, n, count)
        if evals <= n:
            out.setdefault(evals, count)
    return out


def counts_for(kind: str, n: int, fraction: float) -> list[int]:
    """Solver counts of a `kind` baseline for a target compute fraction on n steps: the count with the most
    evaluations ≤ fraction·n and the one with the fewest ≥ fraction·n (one or two counts; the nearest is always
    among them). Below the cheapest option: the cheapest; above the dearest: the dearest."""
    reach = options(kind, n)
    want = fraction * n
    below = [e for e in reach if e <= want + 1e-9]
    above = [e for e in reach if e >= want - 1e-9]
    picked = {max(below) if below else min(reach), min(above) if above else max(reach)}
    return sorted(reach[e] for e in picked)


def setting_label(kind: str, n: int, count: int) -> str:
    """e.g. `Euler 14 steps`, `Heun 7 steps (13 evals)`, `curved 12 of 28 steps`."""
    if kind == "euler":
        return f"Euler {count} steps"
    if kind == "heun":
        return f"Heun {count} steps ({evaluations(kind, n, count)} evals)"
    return f"curved {evaluations(kind, n, count)} of {n} steps"


# ---------------------------------------------------------------------------------------------------- pipeline
@dataclass
class SolverOutput:
    """A baseline run: final packed latents `(1, N, C·p²)` fp32, velocity evaluations and transformer forwards."""

    latents: torch.Tensor
    evaluations: int
    forwards: int


@torch.no_grad()
def sample(
    pipe: Any,
    prompt: str,
    seed: int,
    *,
    kind: str,
    n: int,
    count: int,
    guidance_scale: float,
    height: int,
    width: int,
    variant: str | None = None,
    negative_prompt: str = "",
) -> SolverOutput:
    """One image's latents with a `kind` baseline for an n-step schedule (see the module contract).

    euler / heun: `count` steps on `pipe.sigmas(count, ...)`; curved: n steps on `pipe.sigmas(n, ...)` computing
    `curved_steps(n, count)`. The pipeline must have no cache enabled (its transformer is called directly).
    """
    if kind not in SOLVERS:
        raise ValueError(f"baseline {kind!r} is unknown; allowed: {', '.join(SOLVERS)}")
    rows, cols = pipe.latent_grid(height, width)
    embeds, mask = pipe.encode_prompt([prompt])
    cond = pipe.text_conditioning(embeds, mask, 1)
    uncond = None
    if guidance_scale > 1.0:
        embeds, mask = pipe.encode_prompt([negative_prompt])
        uncond = pipe.text_conditioning(embeds, mask, 1)
    x = pipe.initial_latents(1, height, width, torch.Generator("cpu").manual_seed(int(seed)))
    variant = resolve_variant(pipe, variant)
    sigmas = pipe.sigmas(count if kind != "curved" else n, rows * cols, variant)
    model_t = pipe.scheduler.model_timesteps(sigmas).to(x.device)
    positions = pipe.position_ids(rows, cols, x.device)
    forwards = 0

    def velocity(latents: torch.Tensor, j: int) -> torch.Tensor:
        nonlocal forwards
        t = model_t[j].expand(latents.shape[0])
        v = pipe.transformer(latents, cond, t, positions)
        forwards += 1
        if uncond is not None:
            u = pipe.transformer(latents, uncond, t, positions)
            forwards += 1
            v = guided_velocity(v, u, guidance_scale)
        return v

    sig = [float(s) for s in sigmas]
    step = pipe.scheduler.step
    if kind == "euler":
        x, evals = euler(velocity, x, sig, step)
    elif kind == "heun":
        x, evals = heun(velocity, x, sig, step)
    else:
        x, evals = reuse(velocity, x, sig, curved_steps(n, count), step)
    return SolverOutput(latents=x, evaluations=evals, forwards=forwards)
