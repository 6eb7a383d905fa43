"""Plots of sweep results (matplotlib, imported lazily) and image grids (PIL).

`plot_schedule(results, slug)` draws fidelity vs compute fraction for one schedule: PSNR, SSIM and relative L2 panels,
one colour per method (all cells as dots, the Pareto front as a line), each uncached baseline (fewer-steps Euler,
fewer-steps Heun, the curved schedule) as its own dashed curve. `plot_measures(results, slug)` draws PSNR against the
uncached run and against the high-accuracy reference side by side, one line per method.
The notebook `notebooks/sweep_report.ipynb` calls these on a `results.json`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .analysis import pareto_front
from .metrics import PSNR_CAP_DB

METHOD_STYLE = {
    "ours": {"color": "tab:blue", "marker": "o", "label": "dicache (ours)", "lw": 1.5, "ms": 5},
    "cache-dit": {"color": "tab:orange", "marker": "s", "label": "cache-dit", "lw": 4.0, "ms": 9},
    "fewer-steps": {"color": "tab:gray", "marker": "^", "label": "fewer steps, Euler (no cache)", "lw": 1.5, "ms": 6},
    "heun": {"color": "tab:green", "marker": "v", "label": "fewer steps, Heun (no cache)", "lw": 1.5, "ms": 6},
    "curved": {"color": "tab:purple", "marker": "D", "label": "curved step reuse (no cache)", "lw": 1.5, "ms": 5},
}
BASELINE_CURVES = ("fewer-steps", "heun", "curved")
"""Methods drawn as one dashed line through all their runs (they have one run per compute)."""
PLOT_ORDER = ("fewer-steps", "heun", "curved", "cache-dit", "ours")  # ours last, on top: coinciding fronts stay visible
PANELS = (("psnr", "PSNR (dB) ↑"), ("ssim", "SSIM ↑"), ("rel_l2", "relative L2 on latents ↓"))
PLOTS_DIR = "plots"


def schedule_records(results: dict[str, Any], slug: str) -> dict[str, list[dict[str, Any]]]:
    """The cached and baseline records of one schedule, by method."""
    out: dict[str, list[dict[str, Any]]] = {m: [] for m in METHOD_STYLE}
    for record in results["records"]:
        if record["schedule_slug"] == slug and record["method"] in out:
            out[record["method"]].append(record)
    return out


def plot_schedule(results: dict[str, Any], slug: str, axes: Sequence[Any] | None = None) -> Any:
    """Draw one schedule's fidelity-vs-compute panels; returns the figure (a new one unless `axes` are given).
    Runs identical to the reference (PSNR at the cap, e.g. nothing cached) are left out: they have no finite value."""
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.2), constrained_layout=True)
    else:
        fig = axes[0].figure
    groups = schedule_records(results, slug)
    name = next((s["name"] for s in results["meta"]["schedules"] if s["slug"] == slug), slug)
    for ax, (metric, title) in zip(axes, PANELS):
        for method in PLOT_ORDER:
            records = [r for r in groups[method] if r.get(metric) is not None and r["psnr"] < PSNR_CAP_DB]
            if not records:
                continue
            style = METHOD_STYLE[method]
            xs = [r["compute_fraction"] for r in records]
            ys = [r[metric] for r in records]
            if method in BASELINE_CURVES:
                order = np.argsort(xs)
                ax.plot(
                    np.array(xs)[order],
                    np.array(ys)[order],
                    "--",
                    color=style["color"],
                    marker=style["marker"],
                    lw=style["lw"],
                    ms=style["ms"],
                    label=style["label"],
                )
                continue
            ax.scatter(xs, ys, color=style["color"], marker=style["marker"], alpha=0.35, s=22)
            signed = [dict(r, _y=r[metric] if metric != "rel_l2" else -r[metric]) for r in records]
            front = pareto_front(signed, metric="_y")
            ax.plot(
                [r["compute_fraction"] for r in front],
                [r[metric] for r in front],
                "-",
                color=style["color"],
                marker=style["marker"],
                lw=style["lw"],
                ms=style["ms"],
                alpha=0.7 if method == "cache-dit" else 1.0,
                label=f"{style['label']} (Pareto front)",
            )
        ax.set_xlabel("compute fraction (transformer blocks run / plain)")
        ax.set_ylabel(title)
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
        if metric == "rel_l2":
            ax.set_yscale("log")
    axes[0].set_title(f"{name}: fidelity vs the uncached run")
    axes[0].legend(fontsize=8, loc="lower right")
    return fig


MEASURE_PANELS = (("psnr", "PSNR (dB) vs the uncached run ↑"), ("psnr_ref", "PSNR (dB) vs the {n}-step reference ↑"))


def plot_measures(results: dict[str, Any], slug: str, axes: Sequence[Any] | None = None) -> Any:
    """PSNR vs compute fraction for one schedule against both references (the uncached run; the high-accuracy one,
    when the sweep has it), one line per method: the baselines through all their runs, dicache and cache-dit along
    their Pareto fronts over their settings (dots). The compute-target bins are shaded lightly."""
    import matplotlib.pyplot as plt

    steps = results["meta"].get("reference_steps")
    panels = [(m, t.format(n=steps)) for m, t in MEASURE_PANELS if m == "psnr" or steps]
    if axes is None:
        size = (6.0 * len(panels), 4.6)
        fig, axes = plt.subplots(1, len(panels), figsize=size, constrained_layout=True, squeeze=False)
        axes = axes[0]
    else:
        fig = axes[0].figure
    groups = schedule_records(results, slug)
    name = next((s["name"] for s in results["meta"]["schedules"] if s["slug"] == slug), slug)
    for ax, (metric, title) in zip(axes, panels):
        for i, center in enumerate(results["meta"].get("compute_targets") or []):
            ax.axvspan(center - 0.05, center + 0.05, color="0.5" if i % 2 else "0.7", alpha=0.08, lw=0)
        for method in PLOT_ORDER:
            records = [r for r in groups[method] if r.get(metric) is not None and r[metric] < PSNR_CAP_DB]
            if not records:
                continue
            style = METHOD_STYLE[method]
            if method in BASELINE_CURVES:
                records = sorted(records, key=lambda r: r["compute_fraction"])
                line = "--"
            else:
                ax.scatter(
                    [r["compute_fraction"] for r in records],
                    [r[metric] for r in records],
                    color=style["color"],
                    marker=style["marker"],
                    alpha=0.3,
                    s=20,
                )
                records = pareto_front(records, metric)
                line = "-"
            ax.plot(
                [r["compute_fraction"] for r in records],
                [r[metric] for r in records],
                line,
                color=style["color"],
                marker=style["marker"],
                lw=style["lw"] if method != "cache-dit" else 2.5,
                ms=style["ms"] if method != "cache-dit" else 7,
                label=style["label"] + ("" if method in BASELINE_CURVES else " (Pareto front)"),
            )
        ax.set_xlabel("compute fraction (transformer blocks run / uncached run)")
        ax.set_ylabel(title)
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{name}: dicache vs the same-compute baselines")
    axes[0].legend(fontsize=8, loc="lower right")
    return fig


def save_plots(results: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Two PNGs per schedule under `out_dir/plots/`: `fidelity_<slug>.png` (PSNR, SSIM, rel-L2) and
    `baselines_<slug>.png` (PSNR vs both references, one line per method). Returns their paths."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    paths = []
    for schedule in results["meta"]["schedules"]:
        path = Path(out_dir) / PLOTS_DIR / f"fidelity_{schedule['slug']}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig = plot_schedule(results, schedule["slug"])
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
        path = Path(out_dir) / PLOTS_DIR / f"baselines_{schedule['slug']}.png"
        fig = plot_measures(results, schedule["slug"])
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """`(3, H, W)` float in [0, 1] -> `(H, W, 3)` uint8."""
    return (image.detach().float().clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy()


def save_image_grid(
    top: Sequence[torch.Tensor], bottom: Sequence[torch.Tensor], path: str | Path, gap: int = 2, min_side: int = 128
) -> Path:
    """A PNG with `top` images (the references) in the first row and `bottom` (one setting's outputs) below, one
    column per (prompt, seed), separated by `gap` white pixels. Images: `(3, H, W)` floats in [0, 1]; images smaller
    than `min_side` px are enlarged by an integer factor (nearest neighbour) to stay visible."""
    if len(top) != len(bottom) or not top:
        raise ValueError(f"need as many outputs as references (got {len(top)} and {len(bottom)}), at least one")
    h, w = top[0].shape[-2:]
    k = max(1, -(-min_side // min(h, w)))
    h, w = h * k, w * k
    canvas = np.full((2 * h + gap, len(top) * (w + gap) - gap, 3), 255, np.uint8)
    for i, (a, b) in enumerate(zip(top, bottom)):
        x = i * (w + gap)
        canvas[:h, x : x + w] = to_uint8(a).repeat(k, 0).repeat(k, 1)
        canvas[h + gap :, x : x + w] = to_uint8(b).repeat(k, 0).repeat(k, 1)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas).save(path)
    return path
