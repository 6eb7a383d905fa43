"""dicache against the four same-compute baselines, per compute bin and per quality measure (pure functions).

Baselines: fewer-steps Euler (`fewer-steps`), fewer-steps Heun (`heun`), the `curved` static step-reuse schedule
(`curved`) and cache-dit (`cache-dit`); dicache is `ours`. Records are result records (dicts with `method`,
`compute_fraction` and the measures); they are never modified.

Measures: `psnr`, against the uncached run of the same schedule (penalises a sampler that is more accurate than that
run, e.g. Heun), and `psnr_ref`, against the high-accuracy reference (uncached Euler with `reference_steps` steps),
which does not depend on the sampler under test.

Rule for "the best baseline at a dicache point of compute c" (`rule="interpolate"`, the one targets are judged by):
each baseline's curve is the Pareto front of its records (compute ≤ and PSNR ≥; runs identical to the reference, at the
PSNR cap, left out), its PSNR interpolated linearly in compute between the two front points around c; above its
dearest, that point's value (flagged `extrapolated`; the sweep runs each baseline just below and just above every
compute target, so inside the bins this does not happen). A baseline counts at c only through a run at or below c
(`REACH_TOLERANCE`): below its cheapest run it has no value there (`not reached`, with that run's compute), never the
value of a dearer run. The best baseline is the highest of those that reach c. Conservative alternative
(`rule="at_least"`, reported beside it and labelled so): each baseline's cheapest front point with compute ≥ c.

Bins: a compute target f covers dicache points with compute in [f − w/2, f + w/2), w = `BIN_WIDTH` (the targets'
spacing). A bin's best dicache setting is the one with the largest margin (its PSNR − the best baseline at its
compute; ties: the higher PSNR). A bin without a dicache point has no margin and fails a margin target.

Issue targets, per measure: 28 and 50 steps — margin ≥ `MARGIN_TARGET_DB` in every bin of `MARGIN_TARGET_BINS`;
8 steps — some dicache setting with compute ≤ 0.6 at PSNR ≥ 35 dB (`QUALITY_TARGETS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .analysis import pareto_front
from .metrics import PSNR_CAP_DB
from .settings import ALGORITHMS, algorithm

OURS = "ours"
BASELINE_METHODS = ("fewer-steps", "heun", "curved", "cache-dit")
BASELINE_NAMES = {"fewer-steps": "Euler", "heun": "Heun", "curved": "curved", "cache-dit": "cache-dit"}
MEASURES = ("psnr", "psnr_ref")
BIN_WIDTH = 0.1
MARGIN_TARGET_DB = 1.0
MARGIN_TARGET_STEPS = (28, 50)
MARGIN_TARGET_BINS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
QUALITY_TARGETS = {8: (0.6, 35.0)}
"""steps -> (compute ≤, PSNR ≥ dB) that some dicache setting must reach."""
RULES = ("interpolate", "at_least")
EPS = 1e-9
REACH_TOLERANCE = 0.005
"""A baseline run counts at compute c when its compute is ≤ c + this (compute fractions are ratios of block
counts: this only absorbs rounding, never a dearer step count)."""
NOT_REACHED = "not reached"


def measure_name(metric: str, reference_steps: int | None = None) -> str:
    if metric == "psnr":
        return "PSNR vs the uncached run"
    steps = f"{reference_steps}-step" if reference_steps else "high-accuracy"
    return f"PSNR vs the {steps} Euler reference"


def curve(records: Iterable[Mapping[str, Any]], metric: str) -> list[tuple[float, float]]:
    """(compute, value) points of the records' Pareto front for `metric`, by increasing compute; records without the
    metric or at the PSNR cap (identical to the reference) are left out."""
    usable = [r for r in records if r.get(metric) is not None and r[metric] < PSNR_CAP_DB]
    return [(r["compute_fraction"], r[metric]) for r in pareto_front(usable, metric)]


def value_at(
    points: Sequence[tuple[float, float]], c: float, rule: str = "interpolate"
) -> tuple[float | None, str] | None:
    """A curve's value at compute `c` and how it was read (`interpolated`, `exact`, `extrapolated`, `at_least`), or
    `(None, NOT_REACHED)` when its cheapest run costs more than `c` (+ `REACH_TOLERANCE`), or None (no points; with
    `at_least`, no point with compute ≥ c). See the module's rule."""
    if not points:
        return None
    if rule == "at_least":
        above = [p for p in points if p[0] >= c - EPS]
        return (above[0][1], "at_least") if above else None
    if rule != "interpolate":
        raise ValueError(f"rule={rule!r} is unknown; allowed: {', '.join(RULES)}")
    for x, y in points:
        if abs(x - c) <= EPS:
            return y, "exact"
    if c < points[0][0]:
        return (points[0][1], "exact") if points[0][0] <= c + REACH_TOLERANCE else (None, NOT_REACHED)
    if c > points[-1][0]:
        return points[-1][1], "extrapolated"
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 < c < x1:
            return y0 + (y1 - y0) * (c - x0) / (x1 - x0), "interpolated"
    raise AssertionError("unreachable: c lies within the curve")


def baselines_at(
    curves: Mapping[str, Sequence[tuple[float, float]]], c: float, rule: str = "interpolate"
) -> dict[str, dict[str, Any]]:
    """Each baseline's value at compute `c` (`{"value", "how"}`), for those that ran; one whose cheapest run costs
    more than `c` has `{"value": None, "how": NOT_REACHED, "cheapest": its compute}`."""
    out = {}
    for method, points in curves.items():
        got = value_at(points, c, rule)
        if got is not None:
            out[method] = {"value": got[0], "how": got[1]}
            if got[1] == NOT_REACHED:
                out[method]["cheapest"] = points[0][0]
    return out


def best_of(values: Mapping[str, Mapping[str, Any]]) -> tuple[str, float] | None:
    """(method, value) of the highest baseline that reaches the compute, or None."""
    reached = {m: v for m, v in values.items() if v["value"] is not None}
    if not reached:
        return None
    method = max(reached, key=lambda m: reached[m]["value"])
    return method, reached[method]["value"]


def bin_rows(
    ours: Sequence[Mapping[str, Any]],
    groups: Mapping[str, Sequence[Mapping[str, Any]]],
    metric: str,
    centers: Iterable[float],
    width: float = BIN_WIDTH,
) -> list[dict[str, Any]]:
    """One row per bin centre: the bin's best dicache record against the best baseline at its compute (both rules).

    Row keys: `bin` (centre), `range` ([lo, hi)), `ours` (record or None), `value` (its metric), `baselines` (each
    baseline's `{"value", "how"}` at its compute, or at the bin centre when the bin has no dicache point),
    `best` / `best_value` (best baseline, interpolate rule), `margin` (dB, or None), `at_least` /
    `at_least_value` / `margin_at_least` (the conservative rule).
    """
    curves = {m: curve(groups.get(m, []), metric) for m in BASELINE_METHODS}
    candidates = [r for r in ours if r.get(metric) is not None]
    rows = []
    for center in sorted(set(centers)):
        lo, hi = round(center - width / 2, 9), round(center + width / 2, 9)
        inside = [r for r in candidates if lo - EPS <= r["compute_fraction"] < hi - EPS]
        scored = []
        for record in inside:
            best = best_of(baselines_at(curves, record["compute_fraction"]))
            margin = None if best is None else record[metric] - best[1]
            scored.append((float("-inf") if margin is None else margin, record[metric], record, best, margin))
        row: dict[str, Any] = {"bin": center, "range": [lo, hi], "ours": None, "value": None, "margin": None}
        if scored:
            _, value, record, best, margin = max(scored, key=lambda t: (t[0], t[1]))
            c = record["compute_fraction"]
            row.update(ours=record, value=value, margin=margin)
        else:
            c, best = center, best_of(baselines_at(curves, center))
        row["compute"] = c
        row["baselines"] = baselines_at(curves, c)
        row["best"], row["best_value"] = (None, None) if best is None else best
        conservative = best_of(baselines_at(curves, c, "at_least"))
        row["at_least"], row["at_least_value"] = (None, None) if conservative is None else conservative
        row["margin_at_least"] = (
            None if conservative is None or row["value"] is None else row["value"] - conservative[1]
        )
        rows.append(row)
    return rows


def target_check(
    steps: int,
    ours: Sequence[Mapping[str, Any]],
    groups: Mapping[str, Sequence[Mapping[str, Any]]],
    metric: str,
) -> dict[str, Any] | None:
    """The issue's target for an n-step schedule on one measure, or None when it sets none for `steps`.

    Returns `{"kind": "margin" | "quality", "text", "met", "met_at_least", ...}`: for a margin target also `rows`
    (`bin_rows` over `MARGIN_TARGET_BINS`) and `failed` (bins below the margin); for a quality target the `best`
    dicache record within the compute limit.
    """
    if steps in MARGIN_TARGET_STEPS:
        rows = bin_rows(ours, groups, metric, MARGIN_TARGET_BINS)

        def ok(row: Mapping[str, Any], margin: str, best: str) -> bool:
            if row["ours"] is not None and row[best] is None:
                return True  # no baseline reaches the dicache point's compute: nothing to beat
            return row[margin] is not None and row[margin] >= MARGIN_TARGET_DB - EPS

        return {
            "kind": "margin",
            "text": f"≥ {MARGIN_TARGET_DB:g} dB above the best baseline in every bin "
            + f"{MARGIN_TARGET_BINS[0]:g}–{MARGIN_TARGET_BINS[-1]:g}",
            "met": all(ok(r, "margin", "best") for r in rows),
            "met_at_least": all(ok(r, "margin_at_least", "at_least") for r in rows),
            "failed": [r["bin"] for r in rows if not ok(r, "margin", "best")],
            "rows": rows,
        }
    if steps in QUALITY_TARGETS:
        limit, floor = QUALITY_TARGETS[steps]
        eligible = [r for r in ours if r.get(metric) is not None and r["compute_fraction"] <= limit + EPS]
        best = max(eligible, key=lambda r: (r[metric], -r["compute_fraction"])) if eligible else None
        met = best is not None and best[metric] >= floor
        return {
            "kind": "quality",
            "text": f"some dicache setting with compute ≤ {limit:g} at ≥ {floor:g} dB",
            "met": met,
            "met_at_least": met,
            "best": best,
        }
    return None


def schedule_groups(records: Iterable[Mapping[str, Any]], slug: str) -> dict[str, list[Mapping[str, Any]]]:
    """One schedule's records of ours and the four baselines, by method."""
    out: dict[str, list[Mapping[str, Any]]] = {m: [] for m in (OURS, *BASELINE_METHODS)}
    for record in records:
        if record.get("schedule_slug") == slug and record.get("method") in out:
            out[record["method"]].append(record)
    return out


def compare(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per schedule and measure: the bin rows over the sweep's compute targets and the issue's target check (JSON-
    ready: records are replaced by their `setting`, `key`, compute and metric). Measures without values are left out."""
    meta = results["meta"]
    centers = meta.get("compute_targets") or MARGIN_TARGET_BINS
    out = []
    for schedule in meta["schedules"]:
        groups = schedule_groups(results["records"], schedule["slug"])
        for metric in MEASURES:
            if not any(r.get(metric) is not None for g in groups.values() for r in g):
                continue
            rows = bin_rows(groups[OURS], groups, metric, centers)
            target = target_check(schedule["steps"], groups[OURS], groups, metric)
            out.append(
                {
                    "schedule": schedule["slug"],
                    "schedule_name": schedule["name"],
                    "steps": schedule["steps"],
                    "metric": metric,
                    "measure": measure_name(metric, meta.get("reference_steps")),
                    "rows": [_plain_row(r, metric) for r in rows],
                    "target": None if target is None else _plain_target(target, metric),
                }
            )
    return out


def _brief(record: Mapping[str, Any] | None, metric: str) -> dict[str, Any] | None:
    if record is None:
        return None
    return {
        "setting": record.get("setting"),
        "key": record.get("key"),
        "compute_fraction": record["compute_fraction"],
        metric: record.get(metric),
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)


def _plain_row(row: Mapping[str, Any], metric: str) -> dict[str, Any]:
    plain = {**row, "ours": _brief(row["ours"], metric)}
    for key in ("value", "margin", "best_value", "at_least_value", "margin_at_least", "compute"):
        plain[key] = _r(plain[key])
    plain["baselines"] = {m: {**v, "value": _r(v["value"])} for m, v in row["baselines"].items()}
    return plain


def _plain_target(target: Mapping[str, Any], metric: str) -> dict[str, Any]:
    plain = dict(target)
    if "rows" in plain:
        plain["rows"] = [_plain_row(r, metric) for r in plain["rows"]]
    if "best" in plain:
        plain["best"] = _brief(plain["best"], metric)
    return plain


def algorithm_rows(results: Mapping[str, Any], slug: str, metric: str = "psnr") -> list[dict[str, Any]]:
    """Per algorithm family (`settings.algorithm` of each dicache cell): its best record in each compute bin and the
    margins against the best same-compute baseline (`margin` and `margin_measured`, the same: `bin_rows`' rule, under
    which a baseline whose cheapest run costs more than the record does not count) and
    against the `recommended` family's best record in the same bin (`vs_recommended`). Rows: `algorithm`, `bins` (one
    `bin_rows` row per bin, plus `margin_measured`, `best_measured` and `vs_recommended`)."""
    groups = schedule_groups(results["records"], slug)
    centers = results["meta"].get("compute_targets") or MARGIN_TARGET_BINS
    families: dict[str, list[Mapping[str, Any]]] = {}
    for record in groups[OURS]:
        families.setdefault(algorithm(record.get("settings")), []).append(record)
    per = {name: bin_rows(records, groups, metric, centers) for name, records in families.items()}
    reference = {row["bin"]: row["value"] for row in per.get("recommended", [])}
    out = []
    for name in [a for a in ALGORITHMS if a in per]:
        rows = []
        for row in per[name]:
            base = reference.get(row["bin"])
            value = row["value"]
            best = best_of(row["baselines"])
            rows.append(
                row
                | {
                    "vs_recommended": None if value is None or base is None else value - base,
                    "best_measured": None if best is None else best[0],
                    "margin_measured": None if value is None or best is None else value - best[1],
                }
            )
        out.append({"algorithm": name, "bins": rows})
    return out
