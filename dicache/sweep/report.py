"""The Markdown report of a sweep: a plain function of the results (`results.json`'s content) to text.

It opens with the answer (`answer.answer_lines`: which setting to use at each compute budget and by how much it beats
the best same-compute baseline). Then per schedule: the uncached timings, dicache against the four same-compute
baselines per compute bin and measure (`compare`: PSNR vs the uncached run and vs the high-accuracy reference, the
issue's targets), the goal check (ours vs cache-dit vs fewer steps at every compute budget), recommended settings for
the fidelity targets, the Pareto front, every cell sorted by compute fraction next to its same-compute fewer-steps
baseline, and every baseline run. The method (model, samples, measures, baselines) comes last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import compare
from .analysis import cheapest_reaching, goal_check, pareto_front
from .answer import answer_lines
from .metrics import MS_SSIM_MIN_SIZE, PSNR_CAP_DB
from .plots import PLOTS_DIR, save_plots, schedule_records

REPORT_MD = "report.md"
METHOD_NAMES = {
    "ours": "dicache (ours)",
    "cache-dit": "cache-dit",
    "ours-fp8": "dicache + FP8",
    "ours-int8": "dicache + INT8",
    "ours-fp8-emulated": "dicache + FP8 (emulated)",
    "fewer-steps": "fewer steps, Euler",
    "heun": "fewer steps, Heun",
    "curved": "curved step reuse",
}


def baselines_text(distilled: bool = False) -> str:
    """How the baselines run and how the comparison is made; `distilled`: the model is a distilled few-step
    checkpoint (no CFG, shift pinned at mu = 1.15 at every step count and resolution)."""
    sigmas = (
        "the pipeline's sigmas for the reduced step count (a distilled model: mu pinned at 1.15, no CFG)"
        if distilled
        else "the pipeline's resolution-aware sigmas for the reduced step count"
    )
    return (
        "Baselines at equal compute: fewer-steps Euler (the pipeline's sampler), fewer-steps Heun (predictor Euler, "
        "corrector with the mean velocity, a plain Euler step to σ = 0; compute = evaluations / n), the `curved` "
        "static schedule (n steps, the velocity computed only at round((j/(k−1))^1.5·(n−1)), j < k, and reused in "
        f"between; compute = k/n), all uncached on {sigmas}, and cache-dit. Each uncached baseline runs at the counts "
        "just below and just above every compute target. Rule: each baseline's Pareto front (compute ≤, PSNR ≥) is "
        "interpolated linearly at the dicache point's compute (beyond its dearest run: that run's value, marked "
        "(x)). A baseline counts only through a run at or below the point's compute (+ 0.005): one whose cheapest run "
        "costs more is `not reached` there, never credited with a dearer run. The best of those reaching it is the "
        "comparison, the margin = dicache − best. `margin, ≥ rule`: the conservative alternative, each baseline's "
        "cheapest front point with compute ≥ the dicache point's (a dearer run, on purpose). A bin f holds the "
        "dicache settings with compute in [f − 0.05, f + 0.05); its row shows the one with the largest margin (a bin "
        "without one says so and shows the baselines at f). Targets (issues 11, 20): 28 and 50 steps, ≥ 1 dB above "
        "the best baseline in every bin 0.3–0.8; 8 steps, some dicache setting with compute ≤ 0.6 at ≥ 35 dB"
        + (", and ≥ 1 dB above the student run for fewer steps in every bin 0.5–0.8" if distilled else "")
        + "; per measure."
    )


def _run_cells(r: dict) -> list[str]:
    """The leading cells every run row shares: method, setting, compute fraction, FLOPs ratio, denoise seconds."""
    return [
        METHOD_NAMES[r["method"]],
        r["setting"],
        f"{r['compute_fraction']:.3f}",
        _f(r["flops_ratio"], 3),
        _f(r["denoise_s"], 3),
    ]


def _f(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}{suffix}"


def _p(value: float | None) -> str:
    """A PSNR table cell (dB in the header)."""
    if value is None:
        return "–"
    return "identical" if value >= PSNR_CAP_DB else f"{value:.2f}"


def _db(value: float | None, digits: int = 2) -> str:
    """A PSNR: `identical` at the cap (the outputs are equal), else the value in dB."""
    if value is None:
        return "–"
    return "identical" if value >= PSNR_CAP_DB else f"{value:.{digits}f} dB"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _who(record: dict[str, Any] | None, metric: str = "psnr") -> str:
    if record is None:
        return "–"
    return f"{record['setting']} ({record['compute_fraction']:.2f}, {_db(record[metric], 1)})"


def _goal_table(rows: list[dict[str, Any]], names: list[str], miss: str) -> list[str]:
    """The goal-check table: per compute budget, the best of ours / cache-dit / fewer steps and whether it is met."""
    return _table(
        ["compute ≤", *names, "fewer steps", "met"],
        [
            [
                f"{r['budget']:.3f}",
                _who(r["ours"]),
                _who(r["cache_dit"]),
                _who(r["fewer_steps"]),
                "yes" if r["met"] else miss,
            ]
            for r in rows
        ],
    )


def render_report(results: dict[str, Any]) -> str:
    """The report as Markdown text."""
    meta = results["meta"]
    by_key = {r["key"]: r for r in results["records"]}
    n = len(meta["samples"])
    prompts = len({p for p, _ in meta["samples"]})
    comparisons = compare.compare(results)
    lines = [f"# dicache sweep: {meta['model']}", "", *answer_lines(results)]
    for schedule in meta["schedules"]:
        lines += _schedule_section(results, schedule, by_key, meta["targets"], comparisons)
    lines += [
        "",
        "## Method",
        "",
        f"- model: `{meta['model']}` (fingerprint `{meta['model_id']}`), {meta['num_blocks']} transformer blocks, "
        f"{meta['height']}×{meta['width']} px",
        f"- samples: {n} ({prompts} prompts × seeds), methods: {', '.join(meta['methods'])} + fewer-steps baseline",
        f"- machine: {meta['machine']}; {meta['date']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v),
        "",
        *_family_lines(meta),
        "Fidelity is measured against the uncached run of the same pipeline, prompt and seed, averaged over the "
        f"samples: PSNR = 10·log10(1/MSE) on images in [0, 1] (capped at {PSNR_CAP_DB:g} dB), SSIM (pytorch-msssim; "
        f"MS-SSIM only at ≥ {MS_SSIM_MIN_SIZE} px), relative L2 = ‖a − b‖/‖b‖ on the final latents. Compute fraction "
        "= transformer blocks run / blocks of the uncached run; FLOPs ratio = estimated from the transformer config "
        "and token counts. Ours runs on the native pipeline, cache-dit on diffusers' `Krea2Pipeline` (same checkpoint, "
        "prompts and seeds, equivalent settings, guidance g = s − 1). The fewer-steps baseline is the native pipeline "
        "without cache at round(steps × compute fraction) steps. Speedups are against the same pipeline uncached; "
        "times are wall-clock seconds per image on the machine above, noisy on a shared CPU, where the compute "
        "fraction and the FLOPs ratio are the load-independent measures. diffusers pads text to the prompt's length "
        "rounded up to 32 tokens (padding is masked; the output is unchanged within float noise).",
        "",
        baselines_text(bool(meta.get("is_distilled")))
        + (
            f" PSNR ref: against the uncached {meta['reference_steps']}-step Euler run of the same prompt, seed and "
            "guidance (a high-accuracy reference that does not depend on the sampler under test)."
            if meta.get("reference_steps")
            else ""
        ),
    ]
    for note in meta.get("notes", []):
        lines.append(f"- note: {note}")
    return "\n".join(lines) + "\n"


def _family_lines(meta: dict[str, Any]) -> list[str]:
    """What differs for a family's diffusers pipeline (above the Krea-2 wording that follows), else nothing."""
    if not meta.get("family"):
        return []
    on = meta.get("measured_on", "image")
    where = (
        "the decoded images"
        if on == "image"
        else "the final latents, because the uncached images are flat (a tiny untrained VAE): PSNR of "
        "0.5 + latents / 8 (a peak-to-peak of 8, ±4σ of unit-variance latents), SSIM on the same view"
    )
    return [
        f"**This model is a diffusers pipeline, {meta['family']}**: ours and cache-dit both run the pipeline's own "
        "`__call__` (seed through its generator, the family's guidance), cache-dit through `cache_dit.enable_cache` "
        "on the same pipeline (so both share its uncached references), and the fewer-steps baseline is the same call "
        f"with fewer steps (Heun and curved need Krea-2's pieces; no FLOPs estimate). Fidelity is measured on {where}. "
        "Where the text below says native pipeline or Krea2Pipeline, read this pipeline.",
        "",
    ]


def _bv(entry: dict[str, Any] | None, best: bool = False) -> str:
    """A baseline value cell: dB, marked (x) beyond the baseline's range, bold when it is the best; `not reached`
    (with its cheapest run's compute) when every run of the baseline costs more than the point."""
    if entry is None:
        return "–"
    if entry["value"] is None:
        return f"not reached (cheapest {entry['cheapest']:.2f})"
    mark = {"extrapolated": " (x)"}.get(entry["how"], "")
    text = f"{entry['value']:.2f}{mark}"
    return f"**{text}**" if best else text


def _margin(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2f}"


def _target_line(entry: dict[str, Any]) -> str:
    target = entry["target"]
    if target is None:
        return f"No target for {entry['steps']} steps in the issue; margins for information."
    verdict = "**met**" if target["met"] else "**not met**"
    if target["kind"] == "margin":
        failed = "" if target["met"] else " (bins " + ", ".join(f"{b:g}" for b in target["failed"]) + ")"
        conservative = "met" if target["met_at_least"] else "not met"
        return f"Target: {target['text']}: {verdict}{failed}; with the ≥ rule: {conservative}."
    best = target["best"]
    shown = "no setting" if best is None else _who(best, entry["metric"])
    return f"Target: {target['text']}: {verdict}; best within the limit: {shown}."


def comparison_lines(entry: dict[str, Any], heading: str = "####") -> list[str]:
    """Markdown for one schedule and measure of `compare.compare(results)`: target verdict and the bin table."""
    lines = [f"{heading} {entry['measure']}", "", _target_line(entry), ""]
    header = ["compute bin", "best dicache setting", "compute", "dB"]
    header += [compare.BASELINE_NAMES[m] for m in compare.BASELINE_METHODS]
    header += ["margin dB", "margin, ≥ rule"]
    rows = []
    for r in entry["rows"]:
        ours = r["ours"]
        row = [
            f"{r['bin']:g} ({r['range'][0]:.2f}–{r['range'][1]:.2f})",
            "no dicache run in this bin" if ours is None else ours["setting"],
            f"{r['compute']:.3f}" if ours is not None else f"({r['compute']:.2f})",
            _p(r["value"]),
        ]
        row += [_bv(r["baselines"].get(m), best=m == r["best"]) for m in compare.BASELINE_METHODS]
        row += [_margin(r["margin"]), _margin(r["margin_at_least"])]
        rows.append(row)
    return lines + _table(header, rows)


def algorithm_lines(results: dict[str, Any], slug: str, heading: str = "###") -> list[str]:
    """Markdown: each algorithm family's best PSNR per compute bin, with its margin against the best baseline measured
    at or below its compute and against the recommended family in the same bin (`compare.algorithm_rows`); [] with
    one family."""
    rows = compare.algorithm_rows(results, slug)
    if len(rows) < 2:
        return []
    bins = [b["bin"] for b in rows[0]["bins"]]
    lines = [
        f"{heading} Algorithms side by side: best PSNR per compute bin (margin vs the best baseline / vs recommended)",
        "",
        "Margins in dB against the best baseline with a run at or below the setting's compute (a baseline whose "
        "cheapest run costs more is left out) and against the recommended family's best setting in the same bin.",
        "",
    ]
    body = []
    for row in rows:
        cells = [row["algorithm"]]
        for b in row["bins"]:
            if b["value"] is None:
                cells.append("–")
                continue
            rec = (
                ""
                if b["vs_recommended"] is None or row["algorithm"] == "recommended"
                else f" / {b['vs_recommended']:+.1f}"
            )
            base = "n/a" if b["margin_measured"] is None else f"{b['margin_measured']:+.1f}"
            cells.append(f"{b['value']:.1f} ({base}{rec})")
        body.append(cells)
    return lines + _table(["algorithm", *(f"{c:g}" for c in bins)], body)


def _schedule_section(
    results: dict[str, Any],
    schedule: dict[str, Any],
    by_key: dict[str, dict],
    targets: list[float],
    comparisons: list[dict[str, Any]],
) -> list[str]:
    slug = schedule["slug"]
    groups = schedule_records(results, slug)
    ours, cd, fewer = groups["ours"], groups["cache-dit"], groups["fewer-steps"]
    solver_groups = [groups["fewer-steps"], groups["heun"], groups["curved"]]
    solver_runs = [r for g in solver_groups for r in g]
    lines = ["", f"## {schedule['name']}", ""]
    refs = [r for r in results["records"] if r["schedule_slug"] == slug and r["method"] == "uncached"]
    steps = results["meta"].get("reference_steps")
    for ref in refs:
        agree = f"; vs the native reference: PSNR {_db(ref['psnr_vs_native'], 1)}" if "psnr_vs_native" in ref else ""
        if ref.get("psnr_ref") is not None:
            agree += f"; vs the {steps}-step reference: PSNR {_db(ref['psnr_ref'], 1)}"
        lines.append(
            f"- uncached, {ref['pipeline']} pipeline: denoise {_f(ref['denoise_s'], 3)} s, end-to-end "
            f"{_f(ref['e2e_s'], 3)} s per image ({ref['image_tokens']} image + {ref['text_tokens']} text tokens){agree}"
        )
    if not (ours or cd):
        return lines + ["", "No cells finished yet."]

    lines += ["", f"![fidelity vs compute]({PLOTS_DIR}/fidelity_{slug}.png)"]
    entries = [e for e in comparisons if e["schedule"] == slug]
    if entries:
        lines += ["", "### dicache vs the four same-compute baselines", ""]
        lines += [f"![PSNR vs compute, one line per method]({PLOTS_DIR}/baselines_{slug}.png)"]
        for entry in entries:
            lines += [""] + comparison_lines(entry)
    side = algorithm_lines(results, slug)
    if side:
        lines += [""] + side
    lines += ["", "### Goal check", ""]
    rows = goal_check(ours, cd, fewer, schedule["steps"])
    met = sum(r["met"] for r in rows)
    lines.append(
        "Goal: at every compute budget below 1, our best PSNR ≥ cache-dit's best (ties within 0.05 dB count as equal) "
        f"and > the best fewer-steps run (within the budget + half a step). **Met at {met} of {len(rows)} budgets.**"
    )
    lines.append("")
    lines += _goal_table(rows, ["ours", "cache-dit"], miss="**no**")

    lines += ["", "### Recommended settings", "", "The least-compute setting reaching each mean-PSNR target.", ""]
    lines += _table(
        ["target PSNR", "ours", "cache-dit", "fewer steps", "Heun", "curved"],
        [[f"≥ {t:g} dB"] + [_who(cheapest_reaching(g, t)) for g in (ours, cd, *solver_groups)] for t in targets],
    )

    lines += ["", "### Pareto front (all methods)", ""]
    front = pareto_front([*ours, *cd, *solver_runs])
    lines += _table(
        ["method", "setting", "compute", "PSNR dB", "SSIM", "rel-L2"],
        [
            [
                METHOD_NAMES[r["method"]],
                r["setting"],
                f"{r['compute_fraction']:.3f}",
                _p(r["psnr"]),
                _f(r["ssim"], 4),
                _f(r["rel_l2"], 4),
            ]
            for r in front
        ],
    )

    lines += ["", "### All settings, by compute fraction", ""]
    has_ref = any(r.get("psnr_ref") is not None for r in [*ours, *cd, *solver_runs])
    header = ["method", "setting", "compute", "FLOPs", "denoise s", "speedup", "e2e s", "PSNR dB", "PSNR min", "SSIM"]
    if any(r.get("ms_ssim") is not None for r in [*ours, *cd]):
        header.append("MS-SSIM")
    header += ["rel-L2"] + (["PSNR ref dB", "rel-L2 ref"] if has_ref else [])
    header += ["fewer steps: steps, PSNR", "Δ PSNR dB", "grid"]
    rows = []
    for r in sorted([*ours, *cd], key=lambda r: (r["compute_fraction"], -r["psnr"])):
        base = by_key.get(r.get("baseline_key", ""))
        row = [
            *_run_cells(r),
            _f(r["speedup_denoise"], 2, "×"),
            _f(r["e2e_s"], 3),
            _p(r["psnr"]),
            _p(r["psnr_min"]),
            _f(r["ssim"], 4),
        ]
        if "MS-SSIM" in header:
            row.append(_f(r.get("ms_ssim"), 4))
        delta = None if base is None or base["psnr"] >= PSNR_CAP_DB else r["psnr"] - base["psnr"]
        row.append(_f(r["rel_l2"], 4))
        if has_ref:
            row += [_p(r.get("psnr_ref")), _f(r.get("rel_l2_ref"), 4)]
        row += [
            "–" if base is None else f"{base['steps']}, {_p(base['psnr'])}",
            "–" if delta is None else f"{delta:+.2f}",
            f"[png]({r['grid']})" if r.get("grid") else "–",
        ]
        rows.append(row)
    lines += _table(header, rows)

    if solver_runs:
        lines += ["", "### Baseline runs (no cache)", ""]
        header = ["method", "setting", "compute", "FLOPs", "denoise s", "PSNR dB", "SSIM", "rel-L2"]
        header += ["PSNR ref dB", "rel-L2 ref"] if has_ref else []
        rows = []
        for r in sorted(solver_runs, key=lambda r: (r["method"], r["compute_fraction"])):
            row = [
                *_run_cells(r),
                _p(r["psnr"]),
                _f(r["ssim"], 4),
                _f(r["rel_l2"], 4),
            ]
            if has_ref:
                row += [_p(r.get("psnr_ref")), _f(r.get("rel_l2_ref"), 4)]
            rows.append(row)
        lines += _table(header, rows)
    return lines


def write_report(results: dict[str, Any], out_dir: str | Path) -> Path:
    """Write `report.md` and the plots into `out_dir`; returns the report's path."""
    out = Path(out_dir)
    save_plots(results, out)
    path = out / REPORT_MD
    path.write_text(render_report(results))
    return path


def render_summary(results: dict[str, Any], command: str | None = None, notes: list[str] | None = None) -> str:
    """A compact Markdown section for `benchmarks/RESULTS.md`: per schedule, the goal check (best of each method at
    every compute budget) and the SGLang-default setting side by side."""
    meta = results["meta"]
    by_key = {r["key"]: r for r in results["records"]}
    comparisons = compare.compare(results)
    title = "ours vs the same-compute baselines" if comparisons else "ours vs cache-dit vs fewer steps"
    lines = [
        f"## dicache sweep: {title} ({meta['date']})",
        "",
        f"- command: `{command}`" if command else "- command: `dicache sweep`",
        f"- machine: {meta['machine']}; versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v),
        f"- model: {meta['model']} (fingerprint `{meta['model_id']}`, {meta['num_blocks']} blocks), "
        f"{meta['height']}×{meta['width']} px; {len(meta['samples'])} prompt/seed samples; {len(meta['cells'])} "
        + (
            "dicache settings"
            + (f" and {len(meta['cachedit_cells'])} cache-dit settings" if meta.get("cachedit_cells") else "")
            if comparisons
            else "settings per method"
        )
        + "; PSNR (dB) against the uncached run of the same pipeline"
        + (
            f" and against the uncached {meta['reference_steps']}-step Euler run (PSNR ref)"
            if meta.get("reference_steps")
            else ""
        )
        + ", mean over the samples",
    ]
    lines += [f"- note: {n}" for n in [*(notes or []), *meta.get("notes", [])]]
    if comparisons:
        lines += ["", baselines_text(bool(meta.get("is_distilled")))]
    for schedule in meta["schedules"]:
        groups = schedule_records(results, schedule["slug"])
        ours, cd, fewer = groups["ours"], groups["cache-dit"], groups["fewer-steps"]
        rows = goal_check(ours, cd, fewer, schedule["steps"])
        met = sum(r["met"] for r in rows)
        for entry in (e for e in comparisons if e["schedule"] == schedule["slug"]):
            lines += [""] + comparison_lines(entry | {"measure": f"{schedule['name']}: {entry['measure']}"}, "###")
        side = algorithm_lines(results, schedule["slug"])
        if side:
            lines += [""] + [side[0].replace("### ", f"### {schedule['name']}: ", 1)] + side[1:]
        lines += [
            "",
            f"### {schedule['name']}: ours vs cache-dit (same settings) and fewer steps: goal met at {met} of "
            f"{len(rows)} compute budgets",
            "",
        ]
        lines += _goal_table(rows, ["ours (best)", "cache-dit (best)"], miss="no")
        default = [r for r in (*ours, *cd) if r["setting"] == "F1B0 W4 MC3 R0.24"]
        if default:
            parts = []
            for r in default:
                base = by_key.get(r.get("baseline_key", ""))
                parts.append(
                    f"{METHOD_NAMES[r['method']]} compute {r['compute_fraction']:.2f}, {_db(r['psnr'])}"
                    + (f" (fewer steps: {base['steps']} steps, {_db(base['psnr'])})" if base else "")
                )
            lines += ["", "SGLang default F1B0 W4 MC3 R0.24: " + "; ".join(parts) + "."]
    return "\n".join(lines) + "\n"
