"""Cache statistics of one request: per branch, which steps were computed or cached, the diffs, the compute used."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, Protocol


class ResidualRecorder(Protocol):
    """Listens to every computed call of this context (`RECORDER`): the branch, the step, and the streams at the
    stack's input, after the Fn blocks and after the middle (tuples of the diff streams, e.g. `(h,)`)."""

    def record(self, branch: str, step: int, stack_in: Any, fn_out: Any, middle_out: Any) -> None: ...


RECORDER: contextvars.ContextVar[ResidualRecorder | None] = contextvars.ContextVar("dicache_recorder", default=None)
"""The recorder computed calls report to in this context (None: nobody listens); `dicache calibrate`'s fits use it."""


@dataclass
class BranchStats:
    """One CFG branch of one request. Step indices are 0-based denoising steps."""

    name: str
    computed_steps: list[int] = field(default_factory=list)
    cached_steps: list[int] = field(default_factory=list)
    diffs: dict[int, float] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)

    def record(self, step: int, cached: bool, reason: str, diff: float | None) -> None:
        (self.cached_steps if cached else self.computed_steps).append(step)
        self.reasons[step] = reason
        if diff is not None:
            self.diffs[step] = diff

    @property
    def num_calls(self) -> int:
        return len(self.computed_steps) + len(self.cached_steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "computed_steps": list(self.computed_steps),
            "cached_steps": list(self.cached_steps),
            "diffs": {str(k): round(v, 6) for k, v in self.diffs.items()},
            "reasons": {str(k): v for k, v in self.reasons.items()},
        }


@dataclass
class RequestStats:
    """Statistics of one request over all its branches.

    `compute_fraction` = transformer blocks run / blocks a plain run would have run: a computed call runs all
    `num_blocks`, a cached call only the `Fn + Bn` always-computed blocks and its `cached_step_blocks` middle ones,
    plus the block-equivalents of token subsets (`partial_blocks`); a call the fitted predictor answers runs none.
    """

    num_blocks: int
    fn_blocks: int
    bn_blocks: int
    cached_step_blocks: int = 0
    partial_blocks: float = 0.0
    """Block-equivalents of the token subsets cached calls computed (`cached_step_method=tokens`: each block's
    `cached_step.subset_fraction`)."""
    num_steps: int | None = None
    enabled: bool = True
    branches: dict[str, BranchStats] = field(default_factory=dict)

    def branch(self, name: str) -> BranchStats:
        if name not in self.branches:
            self.branches[name] = BranchStats(name)
        return self.branches[name]

    @property
    def computed_calls(self) -> int:
        return sum(len(b.computed_steps) for b in self.branches.values())

    @property
    def cached_calls(self) -> int:
        return sum(len(b.cached_steps) for b in self.branches.values())

    @property
    def total_calls(self) -> int:
        return self.computed_calls + self.cached_calls

    @property
    def blocks_run(self) -> float:
        """Blocks run over all calls (whole blocks, plus token subsets as fractions of a block: `partial_blocks`)."""
        per_cached = self.fn_blocks + self.bn_blocks + self.cached_step_blocks
        whole = self.computed_calls * self.num_blocks + self.cached_calls * per_cached
        return whole + self.partial_blocks if self.partial_blocks else whole

    @property
    def compute_fraction(self) -> float:
        total = self.total_calls * self.num_blocks
        return self.blocks_run / total if total else 1.0

    @property
    def cached_ratio(self) -> float:
        return self.cached_calls / self.total_calls if self.total_calls else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "num_steps": self.num_steps,
            "num_blocks": self.num_blocks,
            "Fn_compute_blocks": self.fn_blocks,
            "Bn_compute_blocks": self.bn_blocks,
            "cached_step_blocks": self.cached_step_blocks,
            "partial_blocks": round(self.partial_blocks, 6),
            "computed_calls": self.computed_calls,
            "cached_calls": self.cached_calls,
            "compute_fraction": round(self.compute_fraction, 6),
            "branches": {name: b.to_dict() for name, b in self.branches.items()},
        }

    def table(self) -> str:
        """A readable summary: one row per branch."""
        header = ("branch", "calls", "computed", "cached", "cached steps", "median diff")
        rows = [header]
        for b in self.branches.values():
            diffs = sorted(b.diffs.values())
            median = f"{diffs[len(diffs) // 2]:.3f}" if diffs else "-"
            rows.append(
                (
                    b.name,
                    str(b.num_calls),
                    str(len(b.computed_steps)),
                    str(len(b.cached_steps)),
                    _ranges(b.cached_steps) or "-",
                    median,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"compute fraction {self.compute_fraction:.3f} ({self.blocks_run:g} of "
            f"{self.total_calls * self.num_blocks} "
            f"block evaluations; Fn={self.fn_blocks} Bn={self.bn_blocks}"
            + (f" +{self.cached_step_blocks} middle" if self.cached_step_blocks else "")
            + f" of {self.num_blocks} blocks)"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _ranges(steps: list[int]) -> str:
    """[4, 5, 6, 9] -> '4-6,9'."""
    out, start, prev = [], None, None
    for s in sorted(steps):
        if start is None:
            start = prev = s
        elif s == prev + 1:
            prev = s
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = s
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)
