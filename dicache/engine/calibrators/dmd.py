"""DMD: dynamic mode decomposition of the residual's rates of change, a forecaster with an exponential basis (as
cache-dit's DMD calibrator and SGLang's `enable_dmd`; the method is Schmid 2010's exact DMD).

Keeps the last `history` computed residuals `M_0 … M_{m}` at positions `x_0 < … < x_m` (or decreasing sigmas) and
their rates `v_i = (M_{i+1} − M_i) / (x_{i+1} − x_i)`. Exact DMD fits one linear operator `A` with
`v_{i+1} ≈ A v_i` (one step = one computed step) from the snapshot pairs, in the span of the older rates truncated to
rank `rank` (0: every singular value above `1e-7` of the largest), with `ridge` added to the singular values it
inverts. Its eigenvalues `λ` (modulus clamped to ≤ 1: a residual's rate is not allowed to grow) and modes give the
rates ahead, `A^j v_m = Φ Λ^(j−1) b`; a cached step at `c`, `k = (c − x_m) / (x_m − x_{m−1})` steps ahead, gets
`M_m + (x_m − x_{m−1}) · Re Φ ((1 − λ^k) / (1 − λ)) b` (`k` for `λ = 1`). Exact on linear sequences (λ = 1) and on
geometric rates at equal spacing; with two computed residuals it is order-1 TaylorSeer, with one it reuses it.
Everything is computed from the Gram matrix of the rates (inner products, float64), per batch item, so no
residual-sized matrix is decomposed and the forecast is a real combination of the stored rates.
Memory: `history` residual-sized tensors (the newest residual and the rates).
"""

from __future__ import annotations

import torch


class DMDCalibrator:
    """Exact DMD over the rates of the last `history` computed residuals, refitted lazily after each update."""

    def __init__(self, history: int = 6, rank: int = 0, ridge: float = 1e-8) -> None:
        if history < 2:
            raise ValueError(f"dmd_history={history!r} is invalid: must be >= 2")
        self.history, self.rank, self.ridge = history, rank, ridge
        self.reset()

    def update(self, x: float, residual: torch.Tensor, source: torch.Tensor | None = None) -> None:
        if self._nodes and x == self._nodes[-1]:
            self.reset()
        if self._last is not None:
            self._rates.append((residual - self._last) / (x - self._nodes[-1]))
        self._last = residual
        self._nodes.append(x)
        del self._nodes[: -self.history]
        del self._rates[: -(self.history - 1)]
        self._fit = None

    def estimate(self, x: float, source: torch.Tensor | None = None) -> torch.Tensor:
        if self._last is None:
            raise RuntimeError("DMDCalibrator.estimate called before any computed step")
        if not self._rates:
            return self._last
        gap = self._nodes[-1] - self._nodes[-2]
        k = (x - self._nodes[-1]) / gap
        if len(self._rates) < 2:
            return self._last + self._rates[-1] * (gap * k)
        if self._fit is None:
            self._fit = self._fit_modes()
        weights = self._weights(k)  # (B, m − 1): the combination of rates 1..m−1, per batch item
        later = torch.stack(self._rates[1:])  # (m − 1, B, ...)
        shape = (later.shape[0], later.shape[1]) + (1,) * (later.dim() - 2)
        combined = (later * weights.T.reshape(shape).to(later.dtype)).sum(0)
        return self._last + combined * gap

    def _fit_modes(self):
        rates = torch.stack(self._rates)  # (m, B, ...)
        flat = rates.reshape(rates.shape[0], rates.shape[1], -1).float()
        gram = torch.einsum("ibd,jbd->bij", flat, flat).double()  # (B, m, m)
        g_xx, g_xy, x_v = gram[:, :-1, :-1], gram[:, :-1, 1:], gram[:, :-1, -1]
        fits = []
        for b in range(gram.shape[0]):
            evals, vecs = torch.linalg.eigh(g_xx[b])
            s = evals.clamp_min(0).sqrt().flip(0)
            vecs = vecs.flip(1)
            keep = int((s > 1e-7 * s[0]).sum()) if s[0] > 0 else 0
            if self.rank > 0:
                keep = min(keep, self.rank)
            if keep == 0:
                fits.append(None)
                continue
            s_inv = 1.0 / (s[:keep] + self.ridge)
            v = vecs[:, :keep]
            a_tilde = s_inv[:, None] * (v.T @ g_xy[b] @ v) * s_inv[None, :]
            lam, w = torch.linalg.eig(a_tilde)
            lam = lam / lam.abs().clamp_min(1.0)
            amplitudes = torch.linalg.solve(w, (s_inv * (v.T @ x_v[b])).to(w.dtype))
            left = (v * s_inv[None, :]).to(w.dtype) @ w  # V S⁻¹ W: modes as combinations of rates 1..m−1
            fits.append((lam, amplitudes, left))
        return fits

    def _weights(self, k: float) -> torch.Tensor:
        rows = []
        m = len(self._rates) - 1
        for fit in self._fit:
            if fit is None:
                rows.append(torch.zeros(m, dtype=torch.float64))
                continue
            lam, amplitudes, left = fit
            near_one = (lam - 1).abs() < 1e-9
            safe = torch.where(near_one, torch.ones_like(lam) * 2, lam)
            growth = torch.where(near_one, torch.full_like(lam, k), (1 - safe**k) / (1 - safe))
            rows.append((left @ (growth * amplitudes)).real.cpu())
        return torch.stack(rows).to(self._last.device)

    @property
    def ready(self) -> bool:
        return self._last is not None

    @property
    def stored_tensors(self) -> int:
        return len(self._rates) + (self._last is not None)

    def reset(self) -> None:
        self._last: torch.Tensor | None = None
        self._nodes: list[float] = []
        self._rates: list[torch.Tensor] = []
        self._fit = None
