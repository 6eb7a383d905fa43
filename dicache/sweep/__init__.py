"""`dicache sweep`: speedup/quality sweeps of cache settings against the same-compute baselines (fewer-steps Euler,
fewer-steps Heun, the curved static step-reuse schedule, cache-dit).

Modules, one job each: `spec` (schedules, grid cells, grid files), `settings` (setting names, grid axes, labels,
the recommended family), `prompts` (prompt files and samples), `files` (reading JSON/YAML inputs), `runners` /
`cachedit` (generate one image with the native pipeline or a registered family's diffusers pipeline (its own
`__call__`) + dicache or a baseline sampler, or + cache-dit), `progress` (the progress bar, library logs above it),
`solvers` (the uncached baseline samplers), `metrics` (PSNR, SSIM, relative L2), `flops` (FLOPs estimate), `store`
(resumable output folder), `keys` (record keys), `records` (measured records), `run` (the sweep loop), `launch`
(load the models and run), `analysis` (Pareto front, recommendations, goal check), `compare` (dicache vs the four
baselines per compute bin and measure, the issue's targets), `answer` (which setting to use per compute budget),
`report` (Markdown), `plots` (matplotlib figures, image grids). From Python: `run_sweep(spec, out, pipe=pipe)` sweeps a
pipeline you built. `dicache.tuning` samples with `runners` and
names settings with `settings` too.
"""

from __future__ import annotations

from .launch import run_sweep
from .spec import Cell, Schedule, SweepSpec, SweepSpecError, expand_grid, make_cell

__all__ = ["Cell", "Schedule", "SweepSpec", "SweepSpecError", "expand_grid", "make_cell", "run_sweep"]
