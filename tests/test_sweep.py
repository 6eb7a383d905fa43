"""`dicache sweep`: metrics, FLOPs estimate, grid spec, analysis, cache-dit mapping, and an end-to-end sweep of the
native pipeline + cache-dit on a tiny random diffusers-layout checkpoint (outputs, baseline, resume)."""

import json
import pathlib

import pytest
import torch
from tiny_krea2 import build_tiny_pipeline

from dicache.cli import main
from dicache.engine.policies import preset_mask
from dicache.sweep import analysis, metrics
from dicache.sweep.cachedit import cache_dit_settings, unsupported_reason
from dicache.sweep.flops import flops_ratio, krea2_call_flops
from dicache.sweep.spec import (
    Schedule,
    SweepSpec,
    SweepSpecError,
    expand_grid,
    make_cell,
    make_samples,
    read_grid_file,
    read_prompts,
)
from dicache.sweep.store import ResultStore

# ---------------------------------------------------------------------------------------------------- metrics


def test_psnr_follows_its_formula_and_caps_identical_images():
    ref = torch.zeros(2, 3, 16, 16)
    out = torch.stack([torch.full((3, 16, 16), 0.1), torch.full((3, 16, 16), 0.01)])
    assert metrics.psnr(out, ref) == pytest.approx([20.0, 40.0])  # 10·log10(1 / MSE), MSE 1e-2 and 1e-4
    assert metrics.psnr(ref[0], ref[0]) == [metrics.PSNR_CAP_DB]
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.psnr(ref, ref[:, :, :8])


def test_ssim_ms_ssim_and_relative_l2():
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(2, 3, 176, 176, generator=g)
    noisy = (ref + 0.2 * torch.randn(ref.shape, generator=g)).clamp(0, 1)
    assert metrics.ssim(ref, ref) == pytest.approx([1.0, 1.0])
    assert all(0 < v < 0.9 for v in metrics.ssim(noisy, ref))
    assert metrics.ms_ssim(ref[..., :64, :64], ref[..., :64, :64]) is None  # below 161 px
    assert all(0 < v < 1 for v in metrics.ms_ssim(noisy, ref))
    a, b = torch.tensor([[3.0, 4.0]]), torch.tensor([[0.0, 4.0]])
    assert metrics.relative_l2(a, b) == pytest.approx([0.75])  # ‖(3, 0)‖ / ‖(0, 4)‖


# ---------------------------------------------------------------------------------------------------- FLOPs


def test_flops_estimate_equals_torch_flop_counter_on_diffusers_transformer():
    from diffusers import Krea2Pipeline
    from tiny_krea2 import tiny_transformer
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_transformer(num_layers=4)
    image, text = 16, 12
    kwargs = dict(
        hidden_states=torch.randn(1, image, 64),
        encoder_hidden_states=torch.randn(1, text, 3, 32),
        timestep=torch.rand(1),
        position_ids=Krea2Pipeline.prepare_position_ids(text, 4, 4, torch.device("cpu")),
    )
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**kwargs)
    est = krea2_call_flops(model.config, image_tokens=image, text_tokens=text)
    assert est.full == counter.get_total_flops()
    block = counter.get_flop_counts()["Krea2Transformer2DModel.transformer_blocks.0"]
    assert est.per_block == sum(block.values())


def test_flops_ratio():
    call = krea2_call_flops(
        dict(
            num_layers=10,
            intermediate_size=448,
            attention_head_dim=32,
            num_attention_heads=8,
            num_key_value_heads=4,
            text_hidden_dim=128,
            num_text_layers=6,
            text_intermediate_size=256,
        ),
        256,
        16,
    )
    assert flops_ratio(call, calls=8, blocks_run=80, text_runs=1) == pytest.approx(1.0)
    half = flops_ratio(call, calls=8, blocks_run=40, text_runs=1)
    expected = (40 * call.per_block + 8 * call.fixed + call.text) / (80 * call.per_block + 8 * call.fixed + call.text)
    assert half == pytest.approx(expected) and 0.5 < half < 0.6  # the fixed parts keep it above the block fraction


# ---------------------------------------------------------------------------------------------------- spec


def test_schedules_parse_and_map_guidance_to_diffusers():
    s = Schedule.parse("28:4.5")
    assert (s.steps, s.cfg, s.diffusers_guidance, s.slug) == (28, True, 3.5, "n28-cfg4.5")
    t = Schedule.parse(8)
    assert (t.cfg, t.diffusers_guidance, t.name) == (False, 0.0, "8 steps, no CFG")
    assert Schedule.parse({"steps": 8, "variant": "turbo"}).variant == "turbo"
    for bad, match in [("8:0.5", "guidance_scale=0.5"), ("x", "steps"), ("8:1:fast", "variant='fast'")]:
        with pytest.raises(SweepSpecError, match=match):
            Schedule.parse(bad)


def test_grid_cells_validate_like_cache_config():
    cells = expand_grid({"Fn": [1, 2], "RDT": [0.1], "TS": [0, 2]})
    assert [c.label for c in cells] == [
        "F1B0 W4 MC3 R0.1",
        "F1B0 W4 MC3 R0.1 TS2",
        "F2B0 W4 MC3 R0.1",
        "F2B0 W4 MC3 R0.1 TS2",
    ]
    assert cells[0].config.enable_taylorseer is False and cells[1].config.taylorseer_order == 2
    # a union of products; the same resolved settings spelt twice count once
    assert len(expand_grid([{"RDT": [0.24]}, {"residual_diff_threshold": 0.24, "TS": 0}])) == 1
    with pytest.raises(SweepSpecError, match=r"unknown grid key 'Fx'; allowed: .*Fn_compute_blocks.*RDT="):
        make_cell({"Fx": 1})
    with pytest.raises(SweepSpecError, match=r"'max_continuous_cached_steps'=-2 is invalid: must be an integer >= -1"):
        make_cell({"MC": -2})
    with pytest.raises(SweepSpecError, match=r"scm_preset'='fastest' is invalid: must be one of none, slow"):
        make_cell({"SCM": "fastest"})


def test_grid_file_and_prompt_files(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("schedules: ['8', '28:4.5']\ngrid:\n  - {RDT: [0.08, 0.24]}\n  - {SCM: [fast], W: 0}\n")
    data = read_grid_file(grid)
    assert len(expand_grid(data["grid"])) == 3 and data["schedules"] == ["8", "28:4.5"]
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"grids": []}))
    with pytest.raises(SweepSpecError, match=r"unknown key\(s\) \['grids'\]; allowed: model, prompts"):
        read_grid_file(bad)
    held = tmp_path / "heldout_prompts.json"
    held.write_text(
        json.dumps(
            {
                "prompts": [
                    {"prompt": "blue heart", "seed": 1000, "split": "heldout"},
                    {"prompt": "rocket", "seed": 1001, "split": "train"},
                ]
            }
        )
    )
    pairs = read_prompts(held, split="heldout")
    assert pairs == [("blue heart", 1000)]
    assert make_samples(pairs, None) == [("blue heart", 1000)]
    assert make_samples([("a", None), ("b", None), ("c", None)], [1, 2], limit=2) == [
        ("a", 1),
        ("a", 2),
        ("b", 1),
        ("b", 2),
    ]


# ---------------------------------------------------------------------------------------------------- analysis


def _rec(method, cf, p):
    return {"method": method, "compute_fraction": cf, "psnr": p, "setting": f"{method}@{cf}"}


def test_pareto_front_recommendations_and_goal_check():
    ours = [_rec("ours", 0.4, 30.0), _rec("ours", 0.5, 29.0), _rec("ours", 0.6, 36.0), _rec("ours", 0.6, 35.0)]
    assert [r["setting"] for r in analysis.pareto_front(ours)] == ["ours@0.4", "ours@0.6"]
    assert analysis.cheapest_reaching(ours, 35.0)["setting"] == "ours@0.6"
    assert analysis.cheapest_reaching(ours, 40.0) is None
    assert analysis.best_within(ours, 0.55)["psnr"] == 30.0
    cd = [_rec("cache-dit", 0.45, 31.0), _rec("cache-dit", 0.6, 33.0)]
    fewer = [_rec("fewer-steps", 0.5, 28.0), _rec("fewer-steps", 0.6, 34.0)]
    rows = {round(r["budget"], 2): r for r in analysis.goal_check(ours, cd, fewer, steps=10)}
    assert set(rows) == {0.4, 0.45, 0.5, 0.6}
    assert rows[0.4]["met"]  # no cache-dit setting that cheap; fewer steps within 0.45 has none either
    assert not rows[0.45]["met"]  # cache-dit 31 dB > ours 30 dB
    assert rows[0.6]["met"] and rows[0.6]["fewer_steps"]["psnr"] == 34.0


def test_cache_dit_mapping_uses_our_step_mask():
    cell = make_cell({"SCM": "fast", "SCM_POLICY": "static", "W": 0, "TS": 1, "Fn": 2, "Bn": 1})
    kwargs, order = cache_dit_settings(cell.config, Schedule(28, 4.5))
    assert kwargs["steps_computation_mask"] == preset_mask("fast", 28)
    assert kwargs["steps_computation_policy"] == "static" and kwargs["enable_separate_cfg"] is True
    assert (kwargs["Fn_compute_blocks"], kwargs["Bn_compute_blocks"], kwargs["max_warmup_steps"], order) == (2, 1, 0, 1)
    plain, order = cache_dit_settings(make_cell({"RDT": 0.12}).config, Schedule(8))
    assert "steps_computation_mask" not in plain and plain["enable_separate_cfg"] is False and order is None
    assert "sigmas" in unsupported_reason(make_cell({"TS": 1, "taylorseer_distance": "sigma"}).config)
    tokens = make_cell({"SCM": "fast", "SCM_POLICY": "static", "W": 0, "cached_step_method": "tokens"}).config
    assert "cached_step_method='tokens'" in unsupported_reason(tokens)


def test_store_survives_a_cut_line(tmp_path):
    store = ResultStore(tmp_path)
    store.add({"key": "a", "x": 1})
    with store.path.open("a") as f:
        f.write('{"key": "b", "x"')  # interrupted mid-write
    reopened = ResultStore(tmp_path)
    assert "a" in reopened and "b" not in reopened
    reopened.add({"key": "b", "x": 2})
    assert ResultStore(tmp_path).get("b") == {"key": "b", "x": 2}


# ---------------------------------------------------------------------------------------------------- end to end

SIZE = 32
REFERENCE_STEPS = 12
CELLS = [
    {"RDT": 0},  # nothing cached: must reproduce the reference exactly
    {"W": 2, "RDT": 1e9, "MC": -1, "TS": 1},  # caches every step after warm-up
    {"SCM": "fast", "SCM_POLICY": "static", "W": 0},  # forced mask
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("krea2_sweep")
    build_tiny_pipeline(directory, distilled=False)
    return directory


@pytest.fixture(scope="module")
def swept(checkpoint, tmp_path_factory):
    pytest.importorskip("cache_dit", reason="cache-dit (the bench extra) runs the side-by-side comparison")
    out = tmp_path_factory.mktemp("sweep_out")
    grid = out.parent / "grid.json"
    grid.write_text(
        json.dumps(
            {
                "grid": CELLS,
                "schedules": ["6", "4:2.5"],
                "prompts": ["a red apple", "a blue fox"],
                "seeds": [3],
                "height": SIZE,
                "width": SIZE,
                "methods": ["ours", "cache-dit"],
                "baselines": ["euler", "heun", "curved", "cachedit"],
                "compute_targets": [0.5],
                "reference_steps": REFERENCE_STEPS,
            }
        )
    )
    argv = [
        "sweep",
        "--model",
        str(checkpoint),
        "--grid",
        str(grid),
        "--out",
        str(out),
        "--no-progress",
        "--threads",
        "1",
    ]
    assert main(argv) == 0
    return out, argv


def _records(out):
    return json.loads((out / "results.json").read_text())["records"]


def test_sweep_writes_every_output(swept):
    out, _ = swept
    records = _records(out)
    methods = [r["method"] for r in records]
    assert methods.count("ours") == methods.count("cache-dit") == 2 * len(CELLS)
    assert methods.count("uncached") == 4  # per schedule, native and diffusers
    for r in records:
        if r["method"] in ("ours", "cache-dit", "fewer-steps"):
            assert (out / r["grid"]).is_file()
    report = (out / "report.md").read_text()
    for heading in (
        "## 6 steps, no CFG",
        "## 4 steps, CFG 2.5",
        "### Goal check",
        "### Recommended settings",
        "### Pareto front",
        "### All settings, by compute fraction",
    ):
        assert heading in report
    assert (out / "plots" / "fidelity_n6.png").is_file() and (out / "plots" / "fidelity_n4-cfg2.5.png").is_file()
    table = [line for line in report.split("### All settings")[1].split("##")[0].splitlines() if "| dicache" in line]
    fractions = [float(line.split("|")[3]) for line in table]
    assert fractions == sorted(fractions)


def test_sweep_measurements(swept):
    records = _records(swept[0])
    by = {(r["method"], r["schedule_slug"], r.get("setting")): r for r in records}
    keys = {r["key"]: r for r in records}
    for slug, steps, branches in (("n6", 6, ["cond"]), ("n4-cfg2.5", 4, ["cond", "uncond"])):
        ref = by[("uncached", slug, f"{steps} steps, no cache (diffusers)")]
        assert ref["psnr_vs_native"] > 60  # both pipelines sample the same image from one checkpoint and seed
        for method in ("ours", "cache-dit"):
            plain = by[(method, slug, "F1B0 W4 MC3 R0")]
            assert plain["compute_fraction"] == 1.0 and plain["psnr"] == metrics.PSNR_CAP_DB and plain["rel_l2"] == 0
            eager = by[(method, slug, "F1B0 W2 MC-1 R1e+09 TS1")]
            for sample in eager["samples"]:
                assert sample["cached_steps"] == {b: list(range(2, steps)) for b in branches}
            assert eager["compute_fraction"] == pytest.approx((2 * 6 + (steps - 2) * 1) / (steps * 6))
            assert eager["flops_ratio"] > eager["compute_fraction"]  # fixed per-call work is never skipped
            assert 10 < eager["psnr"] < metrics.PSNR_CAP_DB and 0 < eager["ssim"] < 1 and eager["rel_l2"] > 0
            # the same-compute fewer-steps baseline, at round(steps × compute fraction) steps
            base = keys[eager["baseline_key"]]
            assert base["method"] == "fewer-steps" and base["steps"] == round(steps * eager["compute_fraction"])
            assert base["compute_fraction"] == pytest.approx(base["steps"] / steps)
        # equivalent settings make identical decisions on a static mask
        ours, cd = by[("ours", slug, "F1B0 W0 SCM fast/static")], by[("cache-dit", slug, "F1B0 W0 SCM fast/static")]
        mask = preset_mask("fast", steps)
        assert ours["samples"][0]["cached_steps"]["cond"] == [i for i, m in enumerate(mask) if m == 0]
        assert [s["cached_steps"] for s in ours["samples"]] == [s["cached_steps"] for s in cd["samples"]]
        assert ours["compute_fraction"] == cd["compute_fraction"] < 1


def test_sweep_runs_the_same_compute_baselines_and_the_high_accuracy_reference(swept):
    from dicache.sweep import solvers

    out, _ = swept
    results = json.loads((out / "results.json").read_text())
    records = results["records"]
    for slug, steps in (("n6", 6), ("n4-cfg2.5", 4)):
        mine = [r for r in records if r["schedule_slug"] == slug]
        for kind, method in (("heun", "heun"), ("curved", "curved"), ("euler", "fewer-steps")):
            runs = {r["setting"]: r for r in mine if r["method"] == method}
            for count in solvers.counts_for(kind, steps, 0.5):
                record = runs[solvers.setting_label(kind, steps, count)]
                assert record["compute_fraction"] == pytest.approx(solvers.compute_fraction(kind, steps, count))
                assert record["evaluations"] == solvers.evaluations(kind, steps, count)
                assert 10 < record["psnr"] < metrics.PSNR_CAP_DB and (out / record["grid"]).is_file()
        # every measured record also has the sampler-independent measure
        assert all(r["psnr_ref"] is not None and r["rel_l2_ref"] is not None for r in mine)
        native = next(r for r in mine if r["method"] == "uncached" and r["pipeline"] == "native")
        assert 20 < native["psnr_ref"] < metrics.PSNR_CAP_DB  # n steps vs REFERENCE_STEPS steps: close, not equal
    # one reference sample per pipeline, schedule and prompt, one high-accuracy one per guidance and prompt
    assert len(list((out / "refs").glob("*.pt"))) == 2 * 2 * 2 + 2 * 2
    entries = {(e["schedule"], e["metric"]) for e in results["comparison"]}
    assert entries == {(s, m) for s in ("n6", "n4-cfg2.5") for m in ("psnr", "psnr_ref")}
    report = (out / "report.md").read_text()
    assert "### dicache vs the four same-compute baselines" in report
    assert f"#### PSNR vs the {REFERENCE_STEPS}-step Euler reference" in report
    assert (out / "plots" / "baselines_n6.png").is_file()


def test_rerun_recomputes_nothing(swept):
    out, argv = swept
    before = (out / "results.jsonl").read_text()
    assert main(argv) == 0
    assert (out / "results.jsonl").read_text() == before  # every cell and baseline was found, none appended


def test_interrupted_sweep_resumes_where_it_stopped(checkpoint, tmp_path):
    from dicache.sweep.run import Sweep
    from dicache.sweep.runners import NativeRunner

    class Flaky(NativeRunner):
        """Records each generation as (steps, cell label or None); raises KeyboardInterrupt after `fail_after`."""

        def __init__(self, pipe, fail_after=None):
            super().__init__(pipe)
            self.log, self.fail_after = [], fail_after

        def generate(self, prompt, seed, schedule, steps, height, width, cache):
            if self.fail_after is not None and len(self.log) >= self.fail_after:
                raise KeyboardInterrupt
            self.log.append((steps, None if cache is None else cell_label(cache)))
            return super().generate(prompt, seed, schedule, steps, height, width, cache)

    from dicache.sweep.spec import cell_label

    cells = expand_grid(CELLS)
    spec = SweepSpec(
        samples=[("a red apple", 0)],
        schedules=[Schedule(6)],
        cells=cells,
        methods=("ours",),
        height=SIZE,
        width=SIZE,
        baselines=("euler",),
        reference_steps=None,
    )
    pipe = NativeRunner.load(str(checkpoint)).pipe
    quiet = dict(progress=False, log=lambda _: None)
    # warm-up, reference, cell 1 (its baseline is the reference itself), cell 2, then cell 2's baseline is cut
    first = Flaky(pipe, fail_after=4)
    with pytest.raises(KeyboardInterrupt):
        Sweep(spec, tmp_path, first, **quiet).run()
    assert [label for _, label in first.log] == [None, None, cells[0].label, cells[1].label]
    finished = ResultStore(tmp_path).records()
    assert {r["setting"] for r in finished if r["method"] == "ours"} == {cells[0].label, cells[1].label}

    second = Flaky(pipe)
    results = Sweep(spec, tmp_path, second, **quiet).run()
    assert second.log.count((6, None)) == 1  # the warm-up only: the reference came from refs/
    assert {label for _, label in second.log} - {None} == {cells[2].label}  # only the unfinished cell ran
    assert [r for r in results["records"] if r["key"] in {f["key"] for f in finished}] == finished
    assert len([r for r in results["records"] if r["method"] == "ours"]) == len(CELLS)

    third = Flaky(pipe)
    Sweep(spec, tmp_path, third, **quiet).run()
    assert third.log == []


def test_bad_grid_input_is_a_clear_cli_error(tmp_path, capsys):
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"grid": {"Fn": [1], "RDTT": [0.1]}}))
    assert main(["sweep", "--grid", str(grid), "--dry-run", "--prompt", "x"]) == 2
    assert "unknown grid key 'RDTT'" in capsys.readouterr().err
    assert main(["sweep", "--RDT", "-0.5", "--dry-run", "--prompt", "x"]) == 2
    assert "'residual_diff_threshold'=-0.5 is invalid: must be a number >= 0" in capsys.readouterr().err


def test_notebook_redraws_the_plots(swept, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("DICACHE_SWEEP_RESULTS", str(swept[0] / "results.json"))
    notebook = json.loads((pathlib.Path(__file__).parents[1] / "notebooks" / "sweep_report.ipynb").read_text())
    scope = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec("".join(cell["source"]), scope)
    assert set(scope["figures"]) == {"n6", "n4-cfg2.5"}
    fig = scope["figures"]["n6"]
    lines = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    assert any("dicache" in x for x in lines) and any("cache-dit" in x for x in lines)
    assert any("fewer steps" in x for x in lines)
    plt.close("all")


def test_missing_cache_dit_is_said_clearly(checkpoint, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "cache_dit", None)  # `import cache_dit` now raises ImportError
    assert main(["sweep", "--model", str(checkpoint), "--prompt", "x", "--schedules", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert 'pip install "dicache[bench]"' in out and "methods: ours + fewer steps" in out
    argv = [
        "sweep",
        "--model",
        str(checkpoint),
        "--prompt",
        "x",
        "--schedules",
        "4",
        "--RDT",
        "0",
        "--methods",
        "ours",
        "cache-dit",
        "--height",
        str(SIZE),
        "--width",
        str(SIZE),
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    assert main(argv) == 2
    assert 'cache-dit is not installed; install the benchmark extra: pip install "dicache[bench]"' in (
        capsys.readouterr().err
    )


def test_quantization_axis_measures_the_quantized_model_against_the_unquantized_references(checkpoint, tmp_path):
    """`ours-fp8` runs uncached (policy never) and every cell on the quantized model's runner, each measured against
    the unquantized model's references. Here its runner holds an unquantized copy (FP8 needs a GPU), so its uncached
    row must equal the reference exactly and its cached rows must equal ours."""
    from dicache.sweep.run import Sweep
    from dicache.sweep.runners import NativeRunner

    cells = expand_grid(CELLS[1:2])
    spec = SweepSpec(
        samples=[("a red apple", 0)],
        schedules=[Schedule(6)],
        cells=cells,
        methods=("ours", "ours-fp8"),
        height=SIZE,
        width=SIZE,
        baselines=(),
        reference_steps=None,
    )
    native = NativeRunner.load(str(checkpoint))
    twin = NativeRunner.load(str(checkpoint))
    quiet = dict(progress=False, log=lambda _: None)
    with pytest.raises(SweepSpecError, match="ours-fp8.*quantized"):
        Sweep(spec, tmp_path, native, **quiet)
    records = Sweep(spec, tmp_path, native, quantized={"ours-fp8": twin}, **quiet).run()["records"]
    quantized = {r["setting"]: r for r in records if r["method"] == "ours-fp8"}
    ours = {r["setting"]: r for r in records if r["method"] == "ours"}
    uncached = [r for s, r in quantized.items() if s.endswith("policy never")]
    assert len(uncached) == 1 and uncached[0]["compute_fraction"] == 1.0 and uncached[0]["psnr"] >= 99
    assert quantized[cells[0].label]["psnr"] == ours[cells[0].label]["psnr"] < 99
    assert quantized[cells[0].label]["pipeline"] == "ours-fp8"


def test_quantization_axis_cli_errors(checkpoint, tmp_path, capsys):
    base = ["sweep", "--model", str(checkpoint), "--out", str(tmp_path), "--no-progress", "--quick"]
    assert main([*base, "--quantization", "fp8", "--methods", "ours"]) == 2
    assert "pass --dtype bfloat16" in capsys.readouterr().err
    assert main([*base, "--quantization", "int8", "--methods", "ours"]) == 2
    assert "method 'ours-int8' (--quantization int8) is measured against bf16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    if not torch.cuda.is_available():  # bf16 on a CPU: FP8 itself cannot run, said before sweeping
        assert main([*base, "--quantization", "fp8", "--methods", "ours", "--dtype", "bfloat16"]) == 2
        assert "quantization='fp8' needs an NVIDIA GPU" in capsys.readouterr().err


def test_the_progress_bar_total_is_known_first_never_grows_and_library_logs_pass_above_it(checkpoint, tmp_path):
    """The bar's total is set before the first image (the per-cell fewer-steps runs at their most) and only ever
    lowered; a driven library's console log line (as cache-dit's "Acceleration hooks is disabled …") goes through
    tqdm while the bar is open, not straight to the terminal under it."""
    import logging
    import sys

    from dicache.sweep import progress
    from dicache.sweep.run import Sweep
    from dicache.sweep.runners import NativeRunner

    library = logging.getLogger("a_driven_library")
    handler = logging.StreamHandler(sys.stderr)
    library.addHandler(handler)
    library.propagate = False
    totals: list[float] = []
    written: list[str] = []

    class Bar(progress.tqdm):
        monitor_interval = 0  # no monitor thread left running after the test

        def update(self, n=1):
            totals.append(self.total)
            return super().update(n)

        @classmethod
        def write(cls, s, *args, **kwargs):
            written.append(s)

    class Logging(NativeRunner):
        def generate(self, *args, **kwargs):
            library.warning("Acceleration hooks is disabled for: Krea2Transformer.")
            return super().generate(*args, **kwargs)

    spec = SweepSpec(
        samples=[("a red apple", 0)],
        schedules=[Schedule(6)],
        cells=expand_grid(CELLS),
        methods=("ours",),
        height=SIZE,
        width=SIZE,
        baselines=("euler",),
        reference_steps=None,
    )
    try:
        original, progress.tqdm = progress.tqdm, Bar
        runner = Logging(NativeRunner.load(str(checkpoint)).pipe)
        Sweep(spec, tmp_path, runner, progress=True, log=lambda _: None).run()
    finally:
        progress.tqdm = original
        library.removeHandler(handler)
    assert totals and all(b <= a for a, b in zip(totals, totals[1:])) and totals[0] >= len(totals)
    assert written and all("Acceleration hooks is disabled" in line for line in written)
    assert library.handlers == [] and handler.stream is sys.stderr  # the library's handler is back after the bar
