"""Fitting the output predictor (`cached_step_method=fitted`, `engine/cached_step/fitted.py`) through a sweep runner
(our Krea-2's `NativeRunner`, or a family's `FamilyRunner`: its pipeline's own `__call__`), for `dicache calibrate`
(`tuning.PredictorSearch`) and for sweep cells that name no predictor file.

`Trajectory.record` runs the fit samples uncached as one batch and keeps the latents entering each step (the
transformer's input) and the final ones, and the schedule's step sizes. `fit_predictor` then runs the same batch with a
step mask and the predictor, its weights supplied by a `TrajectoryFitter` (`engine/cached_step.FITTER`): at each cached
call it solves the ridge fit on this batch's features against the steering target (the velocity that takes the
current latents to the uncached run's next ones), so every cached step is fitted on the inputs the earlier fitted
steps produced; with CFG both branches at once, on the guided velocity. One batched generation per mask; the uncached
batch is recorded once for all masks.

The fit samples must be training prompts: `fit_samples` makes them from the calibration prompts with other seeds
(`seed + 1 … seed + k`), never from the prompts the result is judged on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.cached_step import (
    DEFAULT_RIDGE,
    DEFAULT_WEIGHT_FLOOR,
    FITTER,
    ComputedCalls,
    FittedWeights,
    sample_weights,
    solve_ridge,
    steering_target,
)
from ..engine.policies import step_mask
from ..errors import ConfigError
from ..settings.cache_config import CacheConfig
from .spec import Schedule

DEFAULT_FIT_SEEDS = 8
"""Seeds per calibration prompt the predictor is fitted on (measured: 8 × 6 captions fit 449 × 64 weights per step
without overfitting, RESULTS.md issue 43)."""


def fit_samples(samples: Sequence[tuple[str, int]], seeds: int = DEFAULT_FIT_SEEDS) -> list[tuple[str, int]]:
    """The fit's samples: each calibration prompt with the seeds `seed + 1 … seed + seeds` (never its own seed)."""
    return [(prompt, seed + k) for prompt, seed in samples for k in range(1, seeds + 1)]


@dataclass(frozen=True)
class BatchRun:
    """A `NativeRunner` at one schedule and size, generating a list of samples as one batch (`__call__`)."""

    runner: Any
    schedule: Schedule
    height: int
    width: int

    def __call__(self, samples: Sequence[tuple[str, int]], config: CacheConfig | None) -> torch.Tensor:
        return self.runner.generate_batch(samples, self.schedule, self.height, self.width, config)


@dataclass
class Trajectory:
    """The uncached run of a batch: the latents `x[step]` `(B, N, C)` entering each step (`x[num_steps]`: the final
    ones) and the Euler step sizes `dt[step] = σ(step + 1) − σ(step)`."""

    x: dict[int, torch.Tensor] = field(default_factory=dict)
    dt: list[float] = field(default_factory=list)

    @classmethod
    def record(cls, run: BatchRun, samples: Sequence[tuple[str, int]]) -> Trajectory:
        """Run `samples` uncached as one batch (`run`) and record it (the step sizes after the run: a family's
        runner reads them from its scheduler's sigmas of that run)."""
        runner = run.runner
        per_step = 2 if run.schedule.cfg else 1
        inputs = []

        def keep(module: Any, args: tuple, kwargs: dict) -> None:
            inputs.append(kwargs.get("hidden_states", args[0] if args else None).detach())

        handle = runner.pipe.transformer.register_forward_pre_hook(keep, with_kwargs=True)
        try:
            final = run(samples, None)
        finally:
            handle.remove()
        trajectory = cls(dt=runner.step_sizes(run.schedule, run.height, run.width))
        if len(inputs) != per_step * len(trajectory.dt) or inputs[0].shape != final.shape:
            raise ConfigError(
                f"cached_step_method='fitted' cannot be fitted on {type(runner.pipe).__name__}: its transformer took "
                f"{len(inputs)} calls for {len(trajectory.dt)} steps ({per_step} a step expected) and hidden_states "
                f"{tuple(inputs[0].shape)}, and the loop ended with latents {tuple(final.shape)} (the same expected)"
            )
        for index in range(0, len(inputs), per_step):  # the branches of a step share its latents
            trajectory.x[index // per_step] = inputs[index]
        trajectory.x[len(trajectory.dt)] = final.to(inputs[0].device)
        return trajectory

    def subset(self, rows: Sequence[int]) -> Trajectory:
        """The trajectory of the batch rows `rows` (in that order)."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return Trajectory(x={step: x[index.to(x.device)] for step, x in self.x.items()}, dt=list(self.dt))

    def target(self, step: int, x: torch.Tensor) -> torch.Tensor:
        """The velocity (guided, with CFG) that takes `x` to the uncached run's next latents in one Euler step."""
        return steering_target(torch.zeros_like(x, dtype=torch.float32), self.x[step + 1], x, self.dt[step])

    def deviation(self, step: int, x: torch.Tensor) -> torch.Tensor:
        """Each sample's mean squared distance `(B,)` of `x` `(B, N, C)` from the uncached run's latents at `step`."""
        return (x.float() - self.x[step].to(x.device).float()).pow(2).mean(dim=tuple(range(1, x.ndim)))


class TrajectoryFitter:
    """The `PredictorFitter` of one fit: each cached call's weights solved on the batch against the steering target
    of the recorded uncached `trajectory` (`Trajectory.target`), each sample weighed by `sample_weights` (1 / its
    distance from the trajectory, `weight_floor`; None: all alike); the weights are kept in `fitted`.

    With CFG (`guidance` s > 1, the pipeline's `cond + (s − 1)(cond − uncond)`) the two branches are fitted together at
    the cond call, on the guided velocity: `[s·f_cond, −(s − 1)·f_uncond] @ [W_cond; W_uncond] ≈ target`, the uncond
    features made from its computed calls at the same input. Fitting each branch to its own target instead leaves
    their errors independent, and the guided velocity multiplies them by s and s − 1: on Raw (28 steps, CFG 4.5) that
    lost 10 dB to TaylorSeer, while the same masks without CFG gained 5 dB (RESULTS.md, issue 43)."""

    def __init__(
        self,
        trajectory: Trajectory,
        ridge: float = DEFAULT_RIDGE,
        guidance: float = 1.0,
        weight_floor: float | None = DEFAULT_WEIGHT_FLOOR,
    ) -> None:
        self.trajectory, self.ridge, self.guidance, self.weight_floor = trajectory, ridge, guidance, weight_floor
        self.fitted: dict[tuple[int, str], torch.Tensor] = {}
        self.pending: dict[tuple[int, str], torch.Tensor] = {}

    def weights(
        self, step: int, branch: str, x: torch.Tensor, features: torch.Tensor, calls: Mapping[str, ComputedCalls]
    ) -> torch.Tensor:
        weight = self.pending.pop((step, branch), None)
        if weight is None:
            target = self.trajectory.target(step, x)
            per_sample = [sample_weights(self.trajectory.deviation(step, x), self.weight_floor).to(x.device)[:, None]]
            other = calls.get("uncond")
            if self.guidance > 1 and branch == "cond" and other is not None and other.ready:
                s, width = self.guidance, features.shape[-1]
                joint = torch.cat([s * features, (1 - s) * other.features(x)], dim=-1)
                both = solve_ridge([joint], [target], self.ridge, per_sample)
                weight, self.pending[(step, "uncond")] = both[:width], both[width:]
            else:
                weight = solve_ridge([features], [target], self.ridge, per_sample)
        self.fitted[(step, branch)] = weight
        return weight


def fit_predictor(
    run: BatchRun,
    samples: Sequence[tuple[str, int]],
    overrides: dict[str, Any],
    trajectory: Trajectory | None = None,
    ridge: float = DEFAULT_RIDGE,
    weight_floor: float | None = DEFAULT_WEIGHT_FLOOR,
) -> FittedWeights:
    """The predictor of the step mask `overrides` set (`cached_step_method=fitted`, no `fitted_predictor`) fitted on
    `samples` (one batched run; `trajectory`: their uncached run, recorded here when None; `ridge`, `weight_floor`:
    `TrajectoryFitter`'s)."""
    trajectory = trajectory if trajectory is not None else Trajectory.record(run, samples)
    fitter = TrajectoryFitter(trajectory, ridge, run.schedule.guidance_scale, weight_floor)
    config = CacheConfig.defaults().merged({**overrides, "enable_cache": True})
    if config.cached_step_method != "fitted" or config.fitted_predictor is not None:
        raise ValueError("fit_predictor fits a cached_step_method='fitted' setting that names no fitted_predictor")
    mask = step_mask(config, run.schedule.steps)
    token = FITTER.set(fitter)
    try:
        run(samples, config)
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
    "BatchRun",
    "Trajectory",
    "TrajectoryFitter",
    "fit_predictor",
    "fit_samples",
]
