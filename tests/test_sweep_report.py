"""The sweep report opens with the answer (which setting at which compute, by how many dB over the best baseline); the
quick grid runs the recommended family; grid axes and labels derive from the settings declarations."""

from __future__ import annotations

import argparse

import pytest

from dicache.settings.cache_config import SETTINGS_BY_KEY
from dicache.sweep import answer, settings
from dicache.sweep.report import render_report
from dicache.sweep.spec import DEFAULT_COMPUTE_TARGETS, QUICK_GRID, expand_grid, make_cell

SLUG = "n28-cfg4.5"
CURVED_04 = make_cell({**settings.RECOMMENDED_FAMILY, "scm_compute_fraction": 0.4}).label


def _record(method: str, setting: str, compute: float, psnr: float, **extra) -> dict:
    return {
        "key": f"{method}-{setting}",
        "method": method,
        "pipeline": "native",
        "schedule_slug": SLUG,
        "setting": setting,
        "steps": 28,
        "compute_fraction": compute,
        "flops_ratio": compute,
        "denoise_s": 1.0,
        "e2e_s": 1.2,
        "speedup_denoise": 1 / compute,
        "psnr": psnr,
        "psnr_min": psnr - 1,
        "ssim": 0.9,
        "ms_ssim": None,
        "rel_l2": 0.05,
        "psnr_ref": None,
        **extra,
    }


def _results() -> dict:
    records = [
        {
            "key": "ref",
            "method": "uncached",
            "pipeline": "native",
            "schedule_slug": SLUG,
            "setting": "28 steps, no cache (native)",
            "denoise_s": 2.0,
            "e2e_s": 2.2,
            "image_tokens": 64,
            "text_tokens": 8,
        },
        _record("ours", CURVED_04, 0.4, 35.0),
        _record("ours", "F1B0 W4 MC3 R0.24", 0.42, 30.0),
        _record("ours", "F1B0 W0 SCM medium/static", 0.6, 33.0),
        _record("curved", "curved 10 of 28", 0.36, 30.0),
        _record("curved", "curved 12 of 28", 0.43, 32.0),
        _record("curved", "curved 16 of 28", 0.57, 34.0),
        _record("curved", "curved 18 of 28", 0.64, 36.0),
        _record("fewer-steps", "11 of 28 steps", 0.39, 28.0),
        _record("fewer-steps", "17 of 28 steps", 0.61, 33.0),
    ]
    meta = {
        "model": "tiny",
        "model_id": "abc",
        "num_blocks": 4,
        "height": 64,
        "width": 64,
        "samples": [["a red apple", 0]],
        "schedules": [{"steps": 28, "guidance_scale": 4.5, "variant": None, "name": "28 steps, CFG 4.5", "slug": SLUG}],
        "methods": ["ours"],
        "baselines": ["euler", "curved"],
        "reference_steps": None,
        "compute_targets": [0.4, 0.6],
        "targets": [30.0],
        "notes": [],
        "versions": {"dicache": "0"},
        "machine": "test",
        "date": "today",
    }
    return {"version": 1, "meta": meta, "records": records}


def test_the_report_opens_with_which_setting_to_use_and_its_margin():
    report = render_report(_results())
    headings = [line for line in report.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Which settings to use"
    assert headings[-1] == "## Method"  # the method comes after the results
    section = report.split("## Which settings to use")[1].split("\n## ")[0]
    # at 0.4: curved 0.4 (35 dB) against the best baseline there, curved interpolated at 0.4: 30 + 2·(0.04/0.07)
    row = next(line for line in section.splitlines() if line.startswith("| 0.4 |"))
    assert f"**{CURVED_04}**" in row and "curved" in row
    assert f"+{35.0 - (30.0 + 2.0 * 0.04 / 0.07):.2f} dB" in row
    # at 0.6 dicache's best (33 dB) loses to curved (34.86 dB): the answer names the baseline and a negative margin
    row = next(line for line in section.splitlines() if line.startswith("| 0.6 |"))
    assert row.split("|")[2].strip().startswith("curved (dicache's best: F1B0 W0 SCM medium/static)")
    assert f"{33.0 - (34.0 + 2.0 * 0.03 / 0.07):+.2f} dB" in row


def test_recommendations_choose_the_largest_margin_per_budget():
    (entry,) = answer.recommendations(_results())
    rows = {r["budget"]: r for r in entry["rows"]}
    assert rows[0.4]["setting"] == CURVED_04 and rows[0.4]["baseline"] == "curved"
    assert rows[0.4]["margin"] == pytest.approx(35.0 - (30.0 + 2.0 * 0.04 / 0.07))
    assert rows[0.6]["margin"] < 0 and rows[0.4]["margin_ref"] is None


def test_the_quick_grid_runs_the_recommended_family_at_every_compute_budget():
    family = [c for c in expand_grid(QUICK_GRID) if settings.RECOMMENDED_FAMILY.items() <= c.overrides.items()]
    assert sorted(c.overrides["scm_compute_fraction"] for c in family) == list(DEFAULT_COMPUTE_TARGETS)
    classic = [c for c in expand_grid(QUICK_GRID) if c not in family]
    assert any("R0.24" in c.label for c in classic)  # the classic settings still run beside it


def test_grid_axes_and_labels_derive_from_the_settings_declarations():
    from dicache import tuning as calibration
    from dicache.commands.sweep import GRID_AXES, add_arguments
    from dicache.sweep import spec

    assert [flag for flag, _, _ in GRID_AXES] == ["Fn", "Bn", "W", "RDT", "MC", "TS", "SCM", "SCM_POLICY"]
    assert all(SETTINGS_BY_KEY[key].short == flag for flag, key, _ in GRID_AXES)
    assert [kind for _, _, kind in GRID_AXES] == [int, int, int, float, int, int, str, str]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--TS", "0", "1", "--RDT", "0.1", "--SCM-POLICY", "static"])
    assert (args.axis_TS, args.axis_RDT, args.axis_SCM_POLICY) == ([0, 1], [0.1], ["static"])
    assert calibration.RECOMMENDED_FAMILY is settings.RECOMMENDED_FAMILY
    assert calibration.label is settings.label and spec.cell_label is settings.cell_label
    assert settings.label({"residual_diff_threshold": 0.5}) == "RDT=0.5"


def test_a_real_sweep_report_opens_with_a_grid_setting_and_its_margin(tmp_path, one_torch_thread):
    """A tiny sweep (random 6-block checkpoint, 8 steps, 32 px): the answer names a cell of the grid per budget."""
    from tiny_krea2 import build_tiny_pipeline

    from dicache.sweep.run import Sweep
    from dicache.sweep.runners import NativeRunner
    from dicache.sweep.spec import Schedule, SweepSpec

    build_tiny_pipeline(tmp_path / "model", distilled=False)
    cells = [make_cell(settings.recommended(0.5, 2.0)), make_cell({"RDT": 0.24})]
    spec = SweepSpec(
        samples=[("a red apple", 0)],
        schedules=[Schedule(8)],
        cells=cells,
        methods=("ours",),
        height=32,
        width=32,
        baselines=("euler", "curved"),
        reference_steps=None,
        compute_targets=(0.5,),
    )
    native = NativeRunner.load(str(tmp_path / "model"))
    results = Sweep(spec, tmp_path / "out", native, progress=False, log=lambda _: None).run()
    report = render_report(results)
    assert [line for line in report.splitlines() if line.startswith("## ")][0] == "## Which settings to use"
    section = report.split("## Which settings to use")[1].split("\n## ")[0]
    row = next(line for line in section.splitlines() if line.startswith("| 0.5 |"))
    assert any(cell.label in row for cell in cells)
    (entry,) = answer.recommendations(results)
    margin = entry["rows"][0]["margin"]
    assert margin is not None and f"{margin:+.2f} dB" in row


def test_a_baseline_whose_cheapest_run_costs_more_than_the_bin_never_counts_there():
    """cache-dit's cheapest run costs 0.66 (issue 42): it must not be the answer in the 0.3 and 0.4 bins, where only
    Euler reaches; a bin no dicache run reaches says so; the 0.7 bin compares cache-dit through its own run."""
    results = _results()
    results["meta"]["methods"] = ["ours", "cache-dit"]
    results["meta"]["compute_targets"] = [0.3, 0.4, 0.5, 0.7]
    results["records"] += [
        _record("ours", "F0 curved 0.3", 0.3, 29.0),
        _record("fewer-steps", "8 of 28 steps", 0.286, 25.0),
        _record("cache-dit", "F1B0 W4 MC3 R0.24", 0.66, 34.91),
        _record("cache-dit", "F1B0 W4 MC3 R0.12", 0.75, 38.0),
        _record("ours", "F1B0 W0 SCM slow/static", 0.7, 37.0),
    ]
    (entry,) = answer.recommendations(results)
    rows = {r["budget"]: r for r in entry["rows"]}
    assert rows[0.3]["baseline"] == "fewer-steps" and rows[0.3]["unreached"] == {"cache-dit": 0.66, "curved": 0.36}
    assert rows[0.3]["margin"] == pytest.approx(29.0 - (25.0 + 3.0 * 0.014 / 0.104))  # Euler 0.286 → 0.39
    assert rows[0.4]["baseline"] == "curved" and "cache-dit" in rows[0.4]["unreached"]
    assert rows[0.7]["baseline"] == "cache-dit"  # 0.66 ≤ 0.7: cache-dit counts, interpolated toward 0.75
    assert rows[0.7]["baseline_psnr"] == pytest.approx(34.91 + (38.0 - 34.91) * 0.04 / 0.09)
    report = render_report(results)
    answer_rows = report.split("## Which settings to use")[1].split("\n## ")[0].splitlines()
    row = next(line for line in answer_rows if line.startswith("| 0.3 |"))
    assert "use cache-dit" not in row and "cache-dit 0.66" in row and "34.91" not in row
    assert row.split("|")[2].strip() == "**F0 curved 0.3**"
    bins = [line for line in report.splitlines() if line.startswith("| 0.3 (0.25–0.35)")]
    assert bins and all("not reached (cheapest 0.66)" in line for line in bins)
    assert "no dicache run in this bin" in next(line for line in report.splitlines() if line.startswith("| 0.5 (0.45"))
