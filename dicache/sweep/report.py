"""The Markdown report of a sweep: a plain function of the results (`results.json`'s content) to text.

Per schedule: the uncached timings, the goal check (ours vs cache-dit vs fewer steps at every compute budget),
recommended settings for the fidelity targets, the Pareto front, and every cell sorted by compute fraction next to
its same-compute fewer-steps baseline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .analysis import cheapest_reaching, goal_check, pareto_front
from .metrics import MS_SSIM_MIN_SIZE, PSNR_CAP_DB
from .plots import PLOTS_DIR, schedule_records

REPORT_MD = "report.md"
METHOD_NAMES = {"ours": "dicache (ours)", "cache-dit": "cache-dit", "fewer-steps": "fewer steps"}


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


def _who(record: dict[str, Any] | None) -> str:
    if record is None:
        return "–"
    return f"{record['setting']} ({record['compute_fraction']:.2f}, {_db(record['psnr'], 1)})"


def render_report(results: dict[str, Any]) -> str:
    """The report as Markdown text."""
    meta = results["meta"]
    by_key = {r["key"]: r for r in results["records"]}
    n = len(meta["samples"])
    prompts = len({p for p, _ in meta["samples"]})
    lines = [
        f"# dicache sweep: {meta['model']}",
        "",
        f"- model: `{meta['model']}` (fingerprint `{meta['model_id']}`), {meta['num_blocks']} transformer blocks, "
        f"{meta['height']}×{meta['width']} px",
        f"- samples: {n} ({prompts} prompts × seeds), methods: {', '.join(meta['methods'])} + fewer-steps baseline",
        f"- machine: {meta['machine']}; {meta['date']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v),
        "",
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
    ]
    for note in meta.get("notes", []):
        lines.append(f"- note: {note}")
    for schedule in meta["schedules"]:
        lines += _schedule_section(results, schedule, by_key, meta["targets"])
    return "\n".join(lines) + "\n"


def _schedule_section(
    results: dict[str, Any], schedule: dict[str, Any], by_key: dict[str, dict], targets: list[float]
) -> list[str]:
    slug = schedule["slug"]
    groups = schedule_records(results, slug)
    ours, cd, fewer = groups["ours"], groups["cache-dit"], groups["fewer-steps"]
    lines = ["", f"## {schedule['name']}", ""]
    refs = [r for r in results["records"] if r["schedule_slug"] == slug and r["method"] == "uncached"]
    for ref in refs:
        agree = f"; vs the native reference: PSNR {_db(ref['psnr_vs_native'], 1)}" if "psnr_vs_native" in ref else ""
        lines.append(
            f"- uncached, {ref['pipeline']} pipeline: denoise {_f(ref['denoise_s'], 3)} s, end-to-end "
            f"{_f(ref['e2e_s'], 3)} s per image ({ref['image_tokens']} image + {ref['text_tokens']} text tokens){agree}"
        )
    if not (ours or cd):
        return lines + ["", "No cells finished yet."]

    lines += ["", f"![fidelity vs compute]({PLOTS_DIR}/fidelity_{slug}.png)", "", "### Goal check", ""]
    rows = goal_check(ours, cd, fewer, schedule["steps"])
    met = sum(r["met"] for r in rows)
    lines.append(
        "Goal: at every compute budget below 1, our best PSNR ≥ cache-dit's best (ties within 0.05 dB count as equal) "
        f"and > the best fewer-steps run (within the budget + half a step). **Met at {met} of {len(rows)} budgets.**"
    )
    lines.append("")
    lines += _table(
        ["compute ≤", "ours", "cache-dit", "fewer steps", "met"],
        [
            [
                f"{r['budget']:.3f}",
                _who(r["ours"]),
                _who(r["cache_dit"]),
                _who(r["fewer_steps"]),
                "yes" if r["met"] else "**no**",
            ]
            for r in rows
        ],
    )

    lines += ["", "### Recommended settings", "", "The least-compute setting reaching each mean-PSNR target.", ""]
    lines += _table(
        ["target PSNR", "ours", "cache-dit", "fewer steps"],
        [[f"≥ {t:g} dB"] + [_who(cheapest_reaching(g, t)) for g in (ours, cd, fewer)] for t in targets],
    )

    lines += ["", "### Pareto front (all methods)", ""]
    front = pareto_front([*ours, *cd, *fewer])
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
    header = ["method", "setting", "compute", "FLOPs", "denoise s", "speedup", "e2e s", "PSNR dB", "PSNR min", "SSIM"]
    if any(r.get("ms_ssim") is not None for r in [*ours, *cd]):
        header.append("MS-SSIM")
    header += ["rel-L2", "fewer steps: steps, PSNR", "Δ PSNR dB", "grid"]
    rows = []
    for r in sorted([*ours, *cd], key=lambda r: (r["compute_fraction"], -r["psnr"])):
        base = by_key.get(r.get("baseline_key", ""))
        row = [
            METHOD_NAMES[r["method"]],
            r["setting"],
            f"{r['compute_fraction']:.3f}",
            _f(r["flops_ratio"], 3),
            _f(r["denoise_s"], 3),
            _f(r["speedup_denoise"], 2, "×"),
            _f(r["e2e_s"], 3),
            _p(r["psnr"]),
            _p(r["psnr_min"]),
            _f(r["ssim"], 4),
        ]
        if "MS-SSIM" in header:
            row.append(_f(r.get("ms_ssim"), 4))
        delta = None if base is None or base["psnr"] >= PSNR_CAP_DB else r["psnr"] - base["psnr"]
        row += [
            _f(r["rel_l2"], 4),
            "–" if base is None else f"{base['steps']}, {_p(base['psnr'])}",
            "–" if delta is None else f"{delta:+.2f}",
            f"[png]({r['grid']})" if r.get("grid") else "–",
        ]
        rows.append(row)
    lines += _table(header, rows)
    return lines


def write_report(results: dict[str, Any], out_dir: str | Path) -> Path:
    """Write `report.md` and the plots into `out_dir`; returns the report's path."""
    from .plots import save_plots

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
    lines = [
        f"## dicache sweep: ours vs cache-dit vs fewer steps ({meta['date']})",
        "",
        f"- command: `{command}`" if command else "- command: `dicache sweep`",
        f"- machine: {meta['machine']}; versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v),
        f"- model: {meta['model']} (fingerprint `{meta['model_id']}`, {meta['num_blocks']} blocks), "
        f"{meta['height']}×{meta['width']} px; {len(meta['samples'])} prompt/seed samples; {len(meta['cells'])} "
        "settings per method; PSNR (dB) against the uncached run of the same pipeline, mean over the samples",
    ]
    lines += [f"- note: {n}" for n in [*(notes or []), *meta.get("notes", [])]]
    for schedule in meta["schedules"]:
        groups = schedule_records(results, schedule["slug"])
        ours, cd, fewer = groups["ours"], groups["cache-dit"], groups["fewer-steps"]
        rows = goal_check(ours, cd, fewer, schedule["steps"])
        met = sum(r["met"] for r in rows)
        lines += ["", f"### {schedule['name']}: goal met at {met} of {len(rows)} compute budgets", ""]
        lines += _table(
            ["compute ≤", "ours (best)", "cache-dit (best)", "fewer steps", "met"],
            [
                [
                    f"{r['budget']:.3f}",
                    _who(r["ours"]),
                    _who(r["cache_dit"]),
                    _who(r["fewer_steps"]),
                    "yes" if r["met"] else "no",
                ]
                for r in rows
            ],
        )
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
