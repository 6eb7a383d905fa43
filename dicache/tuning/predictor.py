"""Fitting the output predictor (`cached_step_method=fitted`, `engine/cached_step/fitted.py`) on a pipeline.

`Trajectory.record` runs the fit samples uncached as one batch and keeps each call's input and output (step and branch
counted in the pipeline's call order: `cond`, then `uncond` with CFG), and the schedule's step sizes. `fit_predictor`
then runs the same batch with a step mask and the predictor, its weights supplied by a `TrajectoryFitter`
(`engine/cached_step.FITTER`): at each cached call it solves the ridge fit on this batch's features against the
steering target (`steering_target`), so every cached step is fitted on the inputs the earlier fitted steps produced.
One batched generation per mask; the uncached batch is recorded once for all masks.

The fit samples must be training prompts: `fit_samples` makes them from the calibration prompts with other seeds
(`seed + 1 … seed + k`), never from the prompts the result is judged on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.cached_step import DEFAULT_RIDGE, FITTER, FittedWeights, solve_ridge, steering_target
from ..settings.cache_config import CacheConfig
from .masks import Mask, mask_bins

DEFAULT_FIT_SEEDS = 8
"""Seeds per calibration prompt the predictor is fitted on (measured: 8 × 6 captions fit 449 × 64 weights per step
without overfitting, RESULTS.md issue 43)."""


def fit_samples(samples: Sequence[tuple[str, int]], seeds: int = DEFAULT_FIT_SEEDS) -> list[tuple[str, int]]:
    """The fit's samples: each calibration prompt with the seeds `seed + 1 … seed + seeds` (never its own seed)."""
    return [(prompt, seed + k) for prompt, seed in samples for k in range(1, seeds + 1)]


def predictor_overrides(mask: Sequence[int], path: str | None = None) -> dict[str, Any]:
    """The candidate computing the steps `mask` flags and predicting the others with the fitted predictor at `path`
    (None while fitting)."""
    compute, cache = mask_bins(mask)
    overrides: dict[str, Any] = {
        "scm_compute_bins": compute,
        "scm_cache_bins": cache,
        "scm_policy": "static",
        "max_warmup_steps": 0,
        "Fn_compute_blocks": 0,
        "cached_step_method": "fitted",
    }
    if path is not None:
        overrides["fitted_predictor"] = str(path)
    return overrides


@dataclass
class Trajectory:
    """The uncached run of a batch: per step its input latents `x[step]` `(B, N, C)`, per (step, branch) the
    transformer's output, and the Euler step sizes `dt[step] = σ(step + 1) − σ(step)`."""

    x: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    dt: list[float] = field(default_factory=list)

    @classmethod
    def record(cls, runner: Any, samples: Sequence[tuple[str, int]]) -> Trajectory:
        """Run `samples` uncached as one batch through `runner` (a `PipelineRunner`) and record it."""
        trajectory = cls(dt=runner.step_sizes())
        branches = ("cond", "uncond") if runner.schedule.cfg else ("cond",)
        calls = []

        def keep(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            x = kwargs.get("hidden_states", args[0] if args else None)
            out = output if isinstance(output, torch.Tensor) else output[0]
            calls.append((x.detach(), out.detach()))

        handle = runner.native.pipe.transformer.register_forward_hook(keep, with_kwargs=True)
        try:
            runner.run_batch(samples, None)
        finally:
            handle.remove()
        for index, (x, out) in enumerate(calls):
            step, branch = divmod(index, len(branches))
            trajectory.x.setdefault(step, x)
            trajectory.v[(step, branches[branch])] = out
        return trajectory


class TrajectoryFitter:
    """The `PredictorFitter` of one fit: each cached call's weights solved on the batch against the steering
    target of the recorded uncached `trajectory`; the weights are kept in `fitted`."""

    def __init__(self, trajectory: Trajectory, ridge: float = DEFAULT_RIDGE) -> None:
        self.trajectory, self.ridge = trajectory, ridge
        self.fitted: dict[tuple[int, str], torch.Tensor] = {}

    def weights(self, step: int, branch: str, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        t = self.trajectory
        target = steering_target(t.v[(step, branch)], t.x[step], x, t.dt[step])
        weight = solve_ridge([features], [target], self.ridge)
        self.fitted[(step, branch)] = weight
        return weight


def fit_predictor(
    runner: Any,
    samples: Sequence[tuple[str, int]],
    mask: Mask,
    trajectory: Trajectory | None = None,
    ridge: float = DEFAULT_RIDGE,
) -> FittedWeights:
    """The predictor of `mask` fitted on `samples` (one batched run of `runner`; `trajectory`: their uncached run,
    recorded here when None)."""
    trajectory = trajectory if trajectory is not None else Trajectory.record(runner, samples)
    fitter = TrajectoryFitter(trajectory, ridge)
    config = CacheConfig.defaults().merged({**predictor_overrides(mask), "enable_cache": True})
    token = FITTER.set(fitter)
    try:
        runner.run_batch(samples, config)
    finally:
        FITTER.reset(token)
    return FittedWeights(
        num_steps=len(mask),
        mask=tuple(mask),
        weights=dict(fitter.fitted),
        ridge=ridge,
        fitted_on=[{"prompt": p, "seed": s} for p, s in samples],
    )


__all__ = [
    "DEFAULT_FIT_SEEDS",
    "Trajectory",
    "TrajectoryFitter",
    "fit_predictor",
    "fit_samples",
    "predictor_overrides",
]
