"""The fitted output predictor (`cached_step_method=fitted`): a cached call's output, predicted without running the
transformer, by a linear map fitted per step and branch on training prompts (`dicache calibrate`).

Features of a call with input `x` `(B, N, C)` (the forward's `hidden_states`: tokens × channels), from the branch's
computed calls, newest first: `v0, v1, v2` their outputs, `x0` the newest one's input (`FEATURES`):
`f = [v0, v1, v2, x, x0, 1]` `(B, N, 5C + 1)`; with fewer than three computed calls the oldest one stands in for the
missing ones. The prediction is `f @ W[step, branch]`, `W` `(5C + 1, C')` for outputs of `C'` channels: per token,
the same channel-mixing map for every token (token positions never mix). It costs `2 · (5C + 1) · C'` FLOPs per token
(64 channels: 41 kFLOP), nothing next to a transformer block.

Fit (`solve_ridge`, `steering_target`): on a cached step `i` of the training samples, run with the weights already
fitted for the earlier cached steps, the target of a branch is the output that puts the next latent back on the
uncached trajectory: `v_ref,b(i) + (x_ref(i) − x(i)) / dt_i`, with `v_ref,b` the branch's output on the uncached run,
`x_ref` its latents and `dt_i = σ(i+1) − σ(i)` (an Euler step `x + dt · v`; with CFG both branches get the same shift,
so the guided velocity is steered and the branches' difference kept). Ridge least squares over every token of every
sample, each sample's rows weighed by `sample_weights` (`D`: 1 / how far the sample is off the uncached latents,
with a floor): `W = (XᵀDX + λ·mean(diag XᵀDX)·I)⁻¹ XᵀDY`, in float64.

Measured on the embedded Turbo student (8 steps; 48 samples of the 6 training captions; RESULTS.md, issue 43): the
steering target beats the greedy one (the exact output at the step's input) by 1–2 dB; `vp` (the previous call's
output, computed or predicted) and the older inputs add nothing; `v2` adds 0.2–0.6 dB. Pure tensor maths: no module,
no decision.
"""

from __future__ import annotations

import contextvars
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

FEATURES = ("v0", "v1", "v2", "x", "x0", "one")
"""The predictor's inputs, in column order (see the module docstring)."""
HISTORY = 3
"""Computed calls a branch keeps (v0, v1, v2)."""
DEFAULT_RIDGE = 1e-3
"""λ of the fit, relative to the mean diagonal of XᵀX (chosen on training captions' other seeds)."""
DEFAULT_WEIGHT_FLOOR = 0.05
"""`sample_weights`' floor in the fit (chosen on Raw 28's training captions' own seeds, RESULTS.md issue 43)."""


def feature_width(channels: int) -> int:
    """Columns of the features of a `channels`-channel input: `5 · channels + 1`."""
    return 5 * channels + 1


@dataclass
class ComputedCalls:
    """One branch's last `HISTORY` computed calls: `(input, output)` pairs, newest last."""

    calls: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    template: Any = None
    """The newest computed call's whole output (a predicted output takes its structure: tensor, tuple, `.sample`)."""

    def record(self, x: torch.Tensor, output: torch.Tensor) -> None:
        self.calls.append((x, output))

    @property
    def ready(self) -> bool:
        """A computed call exists (a prediction needs one)."""
        return bool(self.calls)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """`[v0, v1, v2, x, x0, 1]` `(B, N, 5C + 1)` float32 for a call whose input is `x` `(B, N, C)`."""
        if not self.calls:
            raise RuntimeError("dicache: the fitted predictor needs a computed call before it can predict one")
        newest = list(reversed(self.calls))
        outputs = [newest[min(k, len(newest) - 1)][1] for k in range(HISTORY)]
        x0 = newest[0][0]
        parts = [*outputs, x, x0]
        if any(p.shape[:-1] != x.shape[:-1] for p in parts):
            shapes = ", ".join(str(tuple(p.shape)) for p in parts)
            raise ValueError(f"dicache: the fitted predictor's inputs differ in batch or tokens: {shapes}")
        one = torch.ones(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
        return torch.cat([p.float() for p in parts] + [one], dim=-1)

    def reset(self) -> None:
        self.calls.clear()
        self.template = None


def predict(features: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`features @ weight` in float32, returned in `dtype`: `(B, N, F) @ (F, C') -> (B, N, C')`."""
    return (features @ weight.to(device=features.device, dtype=torch.float32)).to(dtype)


def steering_target(
    reference_output: torch.Tensor, reference_input: torch.Tensor, x: torch.Tensor, dt: float
) -> torch.Tensor:
    """The output that moves `x` onto the uncached trajectory in one Euler step of size `dt` (`x + dt · v`):
    `reference_output + (reference_input − x) / dt`, float32."""
    if dt == 0:
        raise ValueError("steering_target needs a non-zero step size dt")
    return reference_output.float() + (reference_input.float() - x.float()) / dt


def solve_ridge(
    features: Iterable[torch.Tensor],
    targets: Iterable[torch.Tensor],
    ridge: float,
    weights: Iterable[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Ridge least squares `W` `(F, C')` float32 with `rows(features) @ W ≈ rows(targets)`; each input's leading
    axes are flattened into rows (`(..., F)` / `(..., C')`), accumulated in float64. `ridge` is relative to the mean
    of `diag(XᵀX)`. `weights`: per pair, each row's weight in the squared error (a tensor that broadcasts to the
    leading axes, e.g. `(B, 1)` per sample of `(B, N, F)` features); None: all 1."""
    gram = rhs = None
    rows = zip(features, targets, strict=True) if weights is None else zip(features, targets, weights, strict=True)
    for x, y, *weight in rows:
        if weight:
            root = weight[0].to(torch.float64).sqrt().expand(x.shape[:-1]).unsqueeze(-1)
            x, y = x.to(torch.float64) * root, y.to(torch.float64) * root
        xs = x.reshape(-1, x.shape[-1]).to(torch.float64)
        ys = y.reshape(-1, y.shape[-1]).to(torch.float64)
        gram = xs.T @ xs if gram is None else gram + xs.T @ xs
        rhs = xs.T @ ys if rhs is None else rhs + xs.T @ ys
    if gram is None:
        raise ValueError("solve_ridge needs at least one (features, targets) pair")
    scale = gram.diagonal().mean().clamp_min(torch.finfo(torch.float64).tiny)
    gram = gram + ridge * scale * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram, rhs).to(torch.float32)


def sample_weights(deviation: torch.Tensor, floor: float | None) -> torch.Tensor:
    """Each fit sample's weight `(B,)` float32 at a cached step: `1 / (d_b + floor · mean(d))`, scaled to mean 1, with
    `d` `(B,)` the samples' mean squared distance from the uncached latents at this step; all 1 when `floor` is None
    or no sample has left the trajectory (the first cached step). The mean PSNR in dB over the samples moves with
    `Δmse_b / mse_b`, so weighing each sample by 1 / its error follows it to first order (an unweighted fit spends
    itself on the samples furthest off); the floor keeps a sample still near the trajectory from taking all the
    weight."""
    d = deviation.detach().float().flatten()
    if floor is None or not bool(d.mean() > 0):
        return torch.ones_like(d)
    weights = 1.0 / (d + floor * d.mean())
    return weights / weights.mean()


class PredictorFitter(Protocol):
    """Supplies the weights of a cached call while `dicache calibrate` fits them (`FITTER`): given the call's step,
    branch, input `x` `(B, N, C)`, features `(B, N, F)` and every branch's computed calls so far (CFG branches may be
    fitted together), it returns `W` `(F, C')` (fitted on this very batch)."""

    def weights(
        self, step: int, branch: str, x: torch.Tensor, features: torch.Tensor, calls: Mapping[str, ComputedCalls]
    ) -> torch.Tensor: ...


FITTER: contextvars.ContextVar[PredictorFitter | None] = contextvars.ContextVar("dicache_fitter", default=None)
"""The fitter of this context (None: the weights come from `fitted_predictor`); set by `dicache calibrate`."""
