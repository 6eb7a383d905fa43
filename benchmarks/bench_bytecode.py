"""What the compile artifact's bytecode (`dicache.models.artifact_bytecode`) saves a fresh process on an installation
without usable `.pyc` files: the imports of `dicache serve --compile` (torch, torch.compile's modules, transformers'
text-encoder code, the server) in a new interpreter that may not write bytecode, timed three ways, interleaved round
by round:

- no bytecode: `PYTHONPYCACHEPREFIX` an empty folder, so every module is compiled from its source (an image
  installed with `pip --no-compile`, or one whose `.pyc` files were stripped);
- the store's bytecode: the folder a first start wrote (`artifact_bytecode.write` of the same modules), taken as
  `dicache`'s entry takes it (`artifact_bytecode.use`);
- the installation's own `__pycache__` files, for reference.

The page cache is warm in every case (the files were read before): this measures compiling, not the disk.

    python benchmarks/bench_bytecode.py [--rounds 5] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from publish import command_line, publish  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = (
    "torch",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "transformers.models.qwen3_vl.modeling_qwen3_vl",
    "dicache.commands.serve",
    "dicache.server",
    "dicache.models.krea2.pipeline",
)
"""What `dicache serve --compile` imports before it loads, by the modules that pull the rest in."""

IMPORT = """
import importlib, json, sys, time
start = time.perf_counter()
from dicache.models import artifact_bytecode
if sys.argv[1] != "-":
    artifact_bytecode.use(sys.argv[1])
for name in sys.argv[2].split(","):
    importlib.import_module(name)
seconds = time.perf_counter() - start
if len(sys.argv) > 3:  # write the store's bytecode of what was imported
    print(json.dumps(artifact_bytecode.write(sys.argv[3], artifact_bytecode.module_sources()[0])))
print(json.dumps({"seconds": seconds, "modules": len(sys.modules)}))
"""


def run(store: str, env: dict[str, str], *extra: str) -> list[dict]:
    """One fresh interpreter importing `MODULES`, taking `store`'s bytecode ("-": none); its JSON lines (the
    imports' last; with a folder in `extra`, the bytecode written there first)."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORT, store, ",".join(MODULES), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return [json.loads(line) for line in result.stdout.strip().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--results", default=None, help="the results page to append to (benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    from dicache.models import artifact_bytecode

    work = pathlib.Path(tempfile.mkdtemp(prefix="dicache-bench-bytecode-"))
    empty = work / "empty-prefix"
    empty.mkdir()
    store = work / "store"
    base = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(ROOT)}
    base.pop("PYTHONPYCACHEPREFIX", None)
    no_bytecode = {**base, "PYTHONPYCACHEPREFIX": str(empty)}
    store.mkdir()
    written = run("-", no_bytecode, str(artifact_bytecode.folder(store)))[0]
    cases = {
        "no bytecode (every source compiled)": ("-", no_bytecode),
        "the store's bytecode (`artifact_bytecode`)": (str(store), base),
        "the installation's own `__pycache__`": ("-", base),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    modules = 0
    for _ in range(args.rounds):
        for name, (source, env) in cases.items():
            result = run(source, env)[-1]
            times[name].append(result["seconds"])
            modules = result["modules"]
    baseline = statistics.median(times["no bytecode (every source compiled)"])
    lines = ["| imports | median (s) | min (s) | of no bytecode |", "|---|---|---|---|"]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:.2f} | {min(values):.2f} | {median / baseline:.2f} |")
    import torch

    section = (
        f"## Bytecode with the compile artifact: a fresh process's imports ({datetime.date.today()})\n\n"
        f"Command: `{command_line('bench_bytecode.py', argv)}`  \n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__} (CPU; a fresh interpreter per import, `PYTHONDONTWRITEBYTECODE=1`, page cache "
        f"warm)  \nImports: {', '.join(MODULES)} ({modules} modules); {args.rounds} rounds, the three cases "
        f"alternating within each round. The store's bytecode: {written['files']} files.\n\n" + "\n".join(lines) + "\n"
    )
    publish(section, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
