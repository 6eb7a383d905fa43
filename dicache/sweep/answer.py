"""The answer a sweep report opens with: per schedule and compute budget, which dicache setting to use and by how many
dB it beats the best same-compute baseline (a pure function of the results).

The choice per budget is `compare.bin_rows`' (the bin's dicache setting with the largest margin over the best of the
four baselines at its own compute, on PSNR against the uncached run); the same setting's margin on the
sampler-independent measure (PSNR against the high-accuracy reference) is shown beside it when the sweep has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import compare
from .metrics import PSNR_CAP_DB

PRIMARY = "psnr"
SECONDARY = "psnr_ref"


def recommendations(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per schedule: `{"schedule", "name", "rows"}`, a row per compute budget with `budget`, `setting` (None: no
    dicache setting in that bin), `settings`, `compute`, `psnr`, `baseline` (the best baseline at that compute),
    `baseline_psnr`, `margin` (dB) and `margin_ref` (that setting's margin on the high-accuracy measure, or None)."""
    meta = results["meta"]
    centers = meta.get("compute_targets") or compare.MARGIN_TARGET_BINS
    out = []
    for schedule in meta["schedules"]:
        groups = compare.schedule_groups(results["records"], schedule["slug"])
        ref_curves = {m: compare.curve(groups.get(m, []), SECONDARY) for m in compare.BASELINE_METHODS}
        rows = []
        for row in compare.bin_rows(groups[compare.OURS], groups, PRIMARY, centers):
            record, margin_ref = row["ours"], None
            if record is not None and record.get(SECONDARY) is not None:
                best = compare.best_of(compare.baselines_at(ref_curves, record["compute_fraction"]))
                margin_ref = None if best is None else record[SECONDARY] - best[1]
            rows.append(
                {
                    "budget": row["bin"],
                    "setting": None if record is None else record["setting"],
                    "settings": None if record is None else record.get("settings"),
                    "compute": row["compute"],
                    "psnr": row["value"],
                    "baseline": row["best"],
                    "baseline_psnr": row["best_value"],
                    "margin": row["margin"],
                    "margin_ref": margin_ref,
                    "unreached": {m: v["cheapest"] for m, v in row["baselines"].items() if v["value"] is None},
                }
            )
        out.append({"schedule": schedule["slug"], "name": schedule["name"], "rows": rows})
    return out


def _db(value: float | None) -> str:
    if value is None:
        return "–"
    return "identical" if value >= PSNR_CAP_DB else f"{value:.2f}"


def _margin(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2f} dB"


def _baseline_text(row: Mapping[str, Any]) -> str:
    """The best baseline's name, then the baselines whose cheapest run costs more than this compute (left out)."""
    name = "none reaches" if row["baseline"] is None else compare.BASELINE_NAMES[row["baseline"]]
    if not row["unreached"]:
        return name
    out = ", ".join(f"{compare.BASELINE_NAMES[m]} {c:.2f}" for m, c in sorted(row["unreached"].items()))
    return f"{name} (cheapest run dearer, left out: {out})"


def answer_lines(results: Mapping[str, Any]) -> list[str]:
    """The report's opening section, `## Which settings to use`, as Markdown lines."""
    steps = results["meta"].get("reference_steps")
    lines = [
        "## Which settings to use",
        "",
        "Per compute budget (transformer blocks run / uncached, ± 0.05): the dicache setting with the largest margin "
        "over the best same-compute baseline (fewer-steps Euler, fewer-steps Heun, `curved` step reuse, cache-dit), "
        "PSNR against the uncached run; a positive margin means use dicache with that setting, a negative one that the "
        "named baseline is the better choice at that compute. A baseline counts only through a run at or below the "
        "setting's compute; one whose cheapest run costs more is named as left out."
        + (
            f" `margin vs {steps}-step ref`: the same setting on PSNR against the high-accuracy reference."
            if steps
            else ""
        ),
    ]
    for entry in recommendations(results):
        lines += ["", f"### {entry['name']}", ""]
        header = ["compute ≈", "use", "compute", "PSNR dB", "best baseline", "baseline dB", "margin"]
        if steps:
            header.append(f"margin vs {steps}-step ref")
        lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        for r in entry["rows"]:
            baseline = _baseline_text(r)
            name = "–" if r["baseline"] is None else compare.BASELINE_NAMES[r["baseline"]]
            if r["setting"] is None:
                use, compute = f"{name} (no dicache setting in this bin)", "–"
            elif r["baseline"] is None:
                use, compute = f"**{r['setting']}** (no baseline reaches this compute)", f"{r['compute']:.3f}"
            elif r["margin"] is not None and r["margin"] < 0:
                use, compute = f"{name} (dicache's best: {r['setting']})", f"{r['compute']:.3f}"
            else:
                use, compute = f"**{r['setting']}**", f"{r['compute']:.3f}"
            row = [f"{r['budget']:g}", use, compute, _db(r["psnr"]), baseline, _db(r["baseline_psnr"])]
            row.append(_margin(r["margin"]))
            if steps:
                row.append(_margin(r["margin_ref"]))
            lines.append("| " + " | ".join(row) + " |")
    return lines
