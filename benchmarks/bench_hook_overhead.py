"""Hook overhead per denoising step with nothing cached (pytest-benchmark).

One native Krea-2 transformer forward at a CPU-realistic size (8 blocks, width 256, 576 image + 32 text tokens),
timed three ways in one run: plain; hooks installed with the `never` policy (no diff measured); hooks with DBCache
measuring the residual diff every step but never caching (W=0, RDT tiny: the worst case with nothing cached).

    python benchmarks/bench_hook_overhead.py [--results benchmarks/RESULTS.md]

prints a table and, with --results, publishes it (command, machine, date) to the results page (publish.py). The
pytest-benchmark functions below can also be run directly:
`python -m pytest benchmarks/bench_hook_overhead.py --benchmark-only`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from publish import publish  # noqa: E402

import dicache  # noqa: E402
from dicache.models.krea2 import Krea2Transformer  # noqa: E402

CONFIG = dict(
    in_channels=64,
    num_layers=8,
    attention_head_dim=64,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1536,
    timestep_embed_dim=64,
    text_hidden_dim=64,
    num_text_layers=2,
    text_num_attention_heads=2,
    text_num_key_value_heads=2,
    text_intermediate_size=128,
    num_layerwise_text_blocks=1,
    num_refiner_text_blocks=1,
    axes_dims_rope=(16, 24, 24),
)
GRID, TEXT = 24, 32
ROUNDS = 40


def make_inputs():
    torch.manual_seed(0)
    model = Krea2Transformer(**CONFIG).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "scale_shift_table" in name:
                p.normal_(0, 0.05)
    x = torch.randn(1, GRID * GRID, 64)
    text = model.encode_text(torch.randn(1, TEXT, 2, 64))
    ids = torch.zeros(GRID, GRID, 3)
    ids[..., 1] = torch.arange(GRID)[:, None]
    ids[..., 2] = torch.arange(GRID)[None, :]
    return model, x, text, ids.reshape(-1, 3)


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)  # one core: less sensitive to other load on the machine
    return make_inputs()


def _stepper(model, x, text, ids):
    """One forward per call at the next step index; the input drifts a little so every diff is > 0."""
    counter = itertools.count()
    drift = torch.randn_like(x)

    def step():
        i = next(counter)
        with torch.no_grad(), dicache.step(model, i, "cond", sigma=1.0):
            return model(x + 1e-3 * (i % 7) * drift, text, torch.tensor([0.5]), ids)

    return step


def test_plain(benchmark, setup):
    model, x, text, ids = setup
    drift = torch.randn_like(x)
    counter = itertools.count()

    def step():
        i = next(counter)
        with torch.no_grad():
            return model(x + 1e-3 * (i % 7) * drift, text, torch.tensor([0.5]), ids)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=3)


@pytest.mark.parametrize("mode", ["never", "measure_diff"])
def test_hooked(benchmark, setup, mode):
    model, x, text, ids = setup
    config = {"policy": "never"} if mode == "never" else {"max_warmup_steps": 0, "residual_diff_threshold": 1e-12}
    dicache.enable(model, config)
    try:
        with dicache.request(model):
            benchmark.pedantic(_stepper(model, x, text, ids), rounds=ROUNDS, warmup_rounds=3)
            st = dicache.session_of(model).active_request().stats
        assert st.cached_calls == 0
    finally:
        dicache.disable(model)


def interleaved(rounds: int) -> dict[str, list[float]]:
    """CPU seconds per step of the three cases, run alternately round by round so that drifting machine load hits
    all of them alike (the primary figure; pytest-benchmark above runs each case in its own block of rounds)."""
    import time

    torch.set_num_threads(1)
    model, x, text, ids = make_inputs()
    drift = torch.randn_like(x)
    configs = {"never": {"policy": "never"}, "measure_diff": {"max_warmup_steps": 0, "residual_diff_threshold": 1e-12}}
    times: dict[str, list[float]] = {"plain": [], "never": [], "measure_diff": []}
    for r in range(rounds + 2):
        xin = x + 1e-3 * (r % 7) * drift
        for case in times:
            if case != "plain":
                dicache.enable(model, configs[case])
            with torch.no_grad(), contextlib.ExitStack() as stack:
                if case != "plain":
                    stack.enter_context(dicache.request(model))
                    # a reference residual from a previous step, so this step measures the diff
                    with dicache.step(model, 0, "cond", sigma=1.0):
                        model(xin * 0.999, text, torch.tensor([0.5]), ids)
                    stack.enter_context(dicache.step(model, 1, "cond", sigma=1.0))
                start = time.process_time()
                model(xin, text, torch.tensor([0.5]), ids)
                seconds = time.process_time() - start
            if case != "plain":
                dicache.disable(model)
            if r >= 2:  # the first rounds warm up
                times[case].append(seconds)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=None, help="append the table to this Markdown file")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "bench.json"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            __file__,
            "-q",
            "-p",
            "no:cacheprovider",
            "--benchmark-only",
            f"--benchmark-json={report}",
            "--benchmark-disable-gc",
            "--benchmark-timer=time.process_time",  # CPU time of this one-thread process: robust to other load
        ]
        subprocess.run(cmd, check=True)
        data = json.loads(report.read_text())
    medians = {b["name"]: b["stats"]["median"] for b in data["benchmarks"]}
    times = interleaved(args.rounds)
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    labels = {"never": "hooks, policy never", "measure_diff": "hooks, DBCache measuring the diff, nothing cached"}
    bench_names = {"never": "test_hooked[never]", "measure_diff": "test_hooked[measure_diff]"}
    lines = [
        "| case | interleaved: median step (ms) | interleaved: median of per-round overhead "
        "| pytest-benchmark: median step (ms) |",
        "|---|---|---|---|",
        f"| plain forward | {median(times['plain']) * 1e3:.1f} | — | {medians['test_plain'] * 1e3:.1f} |",
    ]
    for case, label in labels.items():
        ratios = [h / p - 1 for h, p in zip(times[case], times["plain"])]
        lines.append(
            f"| {label} | {median(times[case]) * 1e3:.1f} | {100 * median(ratios):+.2f} % "
            f"| {medians[bench_names[case]] * 1e3:.1f} |"
        )
    table = "\n".join(lines)
    machine = f"{platform.machine()}, 1 thread, torch {torch.__version__}"
    section = (
        f"## Hook overhead with nothing cached ({datetime.date.today()})\n\n"
        f"Command: `python benchmarks/bench_hook_overhead.py{f' --results {args.results}' if args.results else ''}`  \n"
        f"Machine: {machine} (CPU; process CPU time per step)  \nModel: native Krea-2 transformer, 8 blocks, "
        f"width 256, {GRID * GRID} image + {TEXT} text tokens, fp32. Interleaved: {args.rounds} rounds, the three "
        f"cases alternating within each round (the primary figure); pytest-benchmark: {ROUNDS} rounds per case, "
        "one case after the other (sensitive to load drifting between cases).\n\n"
        f"{table}\n"
    )
    publish(section, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
