"""`dicache sweep`: speedup/quality sweeps of cache settings against the same-compute baselines (fewer-steps Euler,
fewer-steps Heun, the curved static step-reuse schedule, cache-dit).

Modules, one job each: `spec` (schedules, grid cells, grid files), `runners` / `cachedit` (generate one image with
the native pipeline + dicache or a baseline sampler, or diffusers + cache-dit), `solvers` (the uncached baseline
samplers), `metrics` (PSNR, SSIM, relative L2), `flops` (FLOPs estimate), `store` (resumable output folder), `run`
(the sweep loop), `analysis` (Pareto front, recommendations, goal check), `compare` (dicache vs the four baselines per
compute bin and measure, the issue's targets), `report` (Markdown), `plots` (matplotlib figures, image grids).
"""

from __future__ import annotations

from .spec import Cell, Schedule, SweepSpec, SweepSpecError, expand_grid, make_cell

__all__ = ["Cell", "Schedule", "SweepSpec", "SweepSpecError", "expand_grid", "make_cell", "run_sweep"]


def run_sweep(*args, **kwargs):
    """See `dicache.sweep.run.run_sweep` (imported lazily: it loads torch models)."""
    from .run import run_sweep as _run_sweep

    return _run_sweep(*args, **kwargs)
