"""Pure functions on result records: Pareto fronts, best setting within a compute budget, recommendations, goal check.

A record is a dict with at least `compute_fraction` (float in (0, 1]) and a fidelity metric (default `psnr`, dB,
higher is better). Records are never modified.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

EPS = 1e-9
TIE_DB = 0.05
"""Goal check: ours within this many dB below cache-dit counts as a tie (same settings differ by float noise)."""


def pareto_front(records: Iterable[dict[str, Any]], metric: str = "psnr") -> list[dict[str, Any]]:
    """The records no other record beats (compute ≤ and metric ≥, one of them strictly), by increasing compute."""
    ordered = sorted(records, key=lambda r: (r["compute_fraction"], -r[metric]))
    front: list[dict[str, Any]] = []
    for record in ordered:
        if not front or record[metric] > front[-1][metric] + EPS:
            if front and abs(record["compute_fraction"] - front[-1]["compute_fraction"]) <= EPS:
                continue  # same compute, lower metric (sorted): dominated
            front.append(record)
    return front


def best_within(records: Iterable[dict[str, Any]], budget: float, metric: str = "psnr") -> dict[str, Any] | None:
    """The record with the highest metric among those with compute_fraction ≤ budget (None if there is none)."""
    eligible = [r for r in records if r["compute_fraction"] <= budget + EPS]
    return max(eligible, key=lambda r: (r[metric], -r["compute_fraction"])) if eligible else None


def cheapest_reaching(records: Iterable[dict[str, Any]], target: float, metric: str = "psnr") -> dict[str, Any] | None:
    """The record with the least compute whose metric ≥ target (ties: the higher metric), or None."""
    eligible = [r for r in records if r[metric] >= target]
    return min(eligible, key=lambda r: (r["compute_fraction"], -r[metric])) if eligible else None


def goal_check(
    ours: Sequence[dict[str, Any]],
    cache_dit: Sequence[dict[str, Any]],
    fewer_steps: Sequence[dict[str, Any]],
    steps: int,
    metric: str = "psnr",
    tie: float = TIE_DB,
) -> list[dict[str, Any]]:
    """At each compute budget below 1 (every compute fraction a cached setting of ours or cache-dit reached), the best
    record of each method within it, and whether the goal holds there: ours ≥ cache-dit's best (`tie` dB below counts
    as equal), and ours > the best fewer-steps run within the budget plus half a step (`0.5 / steps`, the rounding of
    round(steps × fraction)).

    A budget where ours has no record fails; a side with no record within the budget does not count against ours.
    Returns one row per budget: `budget`, `ours`, `cache_dit`, `fewer_steps` (records or None) and `met` (bool).
    """
    budgets = sorted({round(r["compute_fraction"], 9) for r in (*ours, *cache_dit)} - {1.0})
    budgets = [b for b in budgets if b < 1.0 - EPS]
    rows = []
    for budget in budgets:
        o = best_within(ours, budget, metric)
        c = best_within(cache_dit, budget, metric)
        f = best_within(fewer_steps, budget + 0.5 / steps, metric)
        met = o is not None
        if met and c is not None:
            met = o[metric] >= c[metric] - tie
        if met and f is not None:
            met = o[metric] > f[metric] + EPS
        rows.append({"budget": budget, "ours": o, "cache_dit": c, "fewer_steps": f, "met": met})
    return rows
