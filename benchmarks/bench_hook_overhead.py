"""Hook overhead per denoising step with nothing cached (pytest-benchmark).

One native Krea-2 transformer forward at a CPU-realistic size (8 blocks, width 256, 1024 image + 32 text tokens),
timed three ways in one run: plain; hooks installed with the `never` policy (no diff measured); hooks with DBCache
measuring the residual diff every step but never caching (W=0, RDT tiny: the worst case with nothing cached).

    python benchmarks/bench_hook_overhead.py [--results benchmarks/RESULTS.md]

prints a table and, with --results, appends it (command, machine, date) to the results file. The pytest-benchmark
functions below can also be run directly: `python -m pytest benchmarks/bench_hook_overhead.py --benchmark-only`.
"""

from __future__ import annotations

import argparse
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

import dicache
from dicache.models.krea2 import Krea2Transformer

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
GRID, TEXT = 32, 32
ROUNDS = 25


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
    torch.set_num_threads(max(1, torch.get_num_threads()))
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=None, help="append the table to this Markdown file")
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
        ]
        subprocess.run(cmd, check=True)
        data = json.loads(report.read_text())
    medians = {b["name"]: b["stats"]["median"] for b in data["benchmarks"]}
    base = medians["test_plain"]
    rows = [("plain forward", base, 0.0)]
    for name, label in (
        ("test_hooked[never]", "hooks, policy never"),
        ("test_hooked[measure_diff]", "hooks, DBCache measuring the diff, nothing cached"),
    ):
        rows.append((label, medians[name], 100.0 * (medians[name] - base) / base))
    lines = ["| case | median step (ms) | overhead vs plain |", "|---|---|---|"]
    lines += [f"| {label} | {t * 1e3:.2f} | {ov:+.2f} % |" for label, t, ov in rows]
    table = "\n".join(lines)
    print(table)
    if args.results:
        machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
        section = (
            f"\n## Hook overhead with nothing cached ({datetime.date.today()})\n\n"
            f"Command: `python benchmarks/bench_hook_overhead.py --results {args.results}`  \n"
            f"Machine: {machine} (CPU)  \nModel: native Krea-2 transformer, 8 blocks, width 256, "
            f"{GRID * GRID} image + {TEXT} text tokens, fp32; median of {ROUNDS} rounds per case, one run.\n\n"
            f"{table}\n"
        )
        path = Path(args.results)
        if not path.exists():
            path.write_text("# Benchmark results\n")
        with path.open("a") as f:
            f.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
