"""The per-model fits `dicache calibrate` stores in the profile: TeaCache's rescale polynomial and MagCache's
magnitude-ratio profile, both from the computed calls of one uncached generation (`fit_algorithms`).

`ResidualTrace` listens to the engine's computed calls (`dicache.engine.stats.RECORDER`) and keeps, per branch and
step `t > 0`: TeaCache's indicator `x_t` (relative L1 change of the Fn residual since step `t − 1`, what the policy
measures), its target `y_t` (the same for the middle's output, the stack's answer), and MagCache's ratio
`mean over tokens of ‖r_t‖ / ‖r_{t−1}‖` of the stack's residual `r = middle output − stack input`. The fits:
`teacache_coefficients`, the least-squares polynomial from `x` to `y` of the highest degree up to 4 that rises on
`[0, 2·max x]` (`fit_rescale`), highest degree first; `magcache_ratios`, one per step (1 at step 0), averaged over
the CFG branches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.stats import RECORDER
from ..settings.cache_config import CacheConfig

FIT_SETTINGS = {"enable_cache": True, "policy": "never", "Fn_compute_blocks": 1, "Bn_compute_blocks": 0}
"""The trace's run: every block computed (nothing cached), the first block's residual as TeaCache's indicator."""
TEACACHE_DEGREE = 4


def _relative_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    den = b.abs().float().mean().item()
    return (a - b).abs().float().mean().item() / den if den > 0 else float("inf")


@dataclass
class ResidualTrace:
    """A `ResidualRecorder`: TeaCache's (x, y) pairs and MagCache's ratios of consecutive computed steps."""

    teacache: list[tuple[float, float]] = field(default_factory=list)
    ratios: dict[int, list[float]] = field(default_factory=dict)
    _last: dict[str, tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def record(self, branch: str, step: int, stack_in: Any, fn_out: Any, middle_out: Any) -> None:
        h_in, h_fn, h_out = stack_in[0], fn_out[0], middle_out[0]
        fn_residual, residual = h_fn - h_in, h_out - h_in
        last = self._last.get(branch)
        if last is not None and last[0] == step - 1:
            _, last_fn, last_out, last_residual = last
            self.teacache.append((_relative_l1(fn_residual, last_fn), _relative_l1(h_out, last_out)))
            norms = torch.linalg.vector_norm(residual.float(), dim=-1)
            last_norms = torch.linalg.vector_norm(last_residual.float(), dim=-1)
            self.ratios.setdefault(step, []).append((norms / (last_norms + 1e-8)).mean().item())
        self._last[branch] = (step, fn_residual, h_out, residual)


def fit_polynomial(points: Sequence[tuple[float, float]], degree: int = TEACACHE_DEGREE) -> list[float]:
    """Least-squares polynomial `y ≈ p(x)` through `points`, highest degree first (degree lowered to fit the points;
    the identity `[1, 0]` without points)."""
    finite = [(x, y) for x, y in points if torch.isfinite(torch.tensor([x, y])).all()]
    if not finite:
        return [1.0, 0.0]
    degree = max(0, min(degree, len({x for x, _ in finite}) - 1))
    xs = torch.tensor([x for x, _ in finite], dtype=torch.float64)
    ys = torch.tensor([y for _, y in finite], dtype=torch.float64)
    vander = torch.stack([xs**k for k in range(degree, -1, -1)], dim=1)
    solution = torch.linalg.lstsq(vander, ys.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    return [float(c) for c in solution]


def _rises(coefficients: Sequence[float], top: float) -> bool:
    """`p` is non-decreasing on `[0, top]` and positive at `top` (checked on 201 points)."""
    values = [sum(c * (top * i / 200) ** k for k, c in enumerate(reversed(coefficients))) for i in range(201)]
    return values[-1] > 0 and all(b >= a - 1e-12 for a, b in zip(values, values[1:]))


def fit_rescale(points: Sequence[tuple[float, float]], degree: int = TEACACHE_DEGREE) -> list[float]:
    """TeaCache's rescale: the highest-degree (`<= degree`) least-squares fit that is non-decreasing and ends positive
    on `[0, 2·max x]` (a larger change never counts less, also a little beyond the measured range), else the
    identity `[1, 0]`. The policy clamps negative values (a small change below the fit's zero) to 0."""
    finite = [x for x, y in points if torch.isfinite(torch.tensor([x, y])).all()]
    if not finite:
        return [1.0, 0.0]
    for d in range(degree, 0, -1):
        coefficients = fit_polynomial(points, d)
        if _rises(coefficients, 2 * max(finite)):
            return coefficients
    return [1.0, 0.0]


def magcache_profile(ratios: dict[int, list[float]], num_steps: int) -> list[float]:
    """One ratio per step: 1 at step 0 (and where nothing was measured), else the branches' mean."""
    return [sum(ratios[t]) / len(ratios[t]) if ratios.get(t) else 1.0 for t in range(num_steps)]


def fit_algorithms(runner: Any, prompt: str, seed: int) -> dict[str, Any]:
    """`teacache_coefficients` and `magcache_ratios` from one uncached generation of (`prompt`, `seed`) by `runner`
    (a `tuning.Runner`), as request keys."""
    trace = ResidualTrace()
    token = RECORDER.set(trace)
    try:
        runner.run(prompt, seed, CacheConfig.defaults().merged(FIT_SETTINGS))
    finally:
        RECORDER.reset(token)
    return {
        "teacache_coefficients": fit_rescale(trace.teacache),
        "magcache_ratios": [round(r, 6) for r in magcache_profile(trace.ratios, runner.steps)],
    }
