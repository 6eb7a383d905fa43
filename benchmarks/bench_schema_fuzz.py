"""The API fuzzed from its own schema, as CI fuzzes it, with its figures published: requests generated per run, images
made, 5xx answers, hangs, CPU and wall seconds.

The same runs as `tests/test_schema_fuzz.py` (and, with `--ray`, the Ray Serve HTTP path of `tests/test_ray_serve.py`):
`schemathesis run` with every check, all four phases, derandomised, against `dicache serve` on the embedded Turbo
student on the CPU with the fuzz's bounds (`tests/schema_fuzz.py`: `SERVE_FLAGS`). A run that finds a failure, an
error or a hang, or a server that counts a 5xx or a failed generation, makes the exit status 1.

    python benchmarks/bench_schema_fuzz.py [--ray] [--results benchmarks/RESULTS.md]     # 2 CPU cores: ~2-4 min
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # the fuzz's shared helpers and hooks: one definition for CI and this

from publish import command_line, markdown_table, publish  # noqa: E402

SINGLE_PROCESS_RUNS = {  # name: (server, send the key, max examples per operation, schemathesis.toml)
    "with the API key": ("keyed", True, 40, ""),
    "without the key (every /v1/* answer a 401)": ("keyed", False, 40, ""),
    "no API key configured (generations: schema-invalid only)": ("open", False, 40, "NO_POSITIVE_GENERATIONS"),
}


def fuzz_single_process(out: pathlib.Path) -> list[dict]:
    """The three single-process runs of `tests/test_schema_fuzz.py`: one row each."""
    import torch
    from schema_fuzz import KEY, SERVE_FLAGS, answered, generations, schemathesis_run, server_counts
    from schema_fuzz import NO_POSITIVE_GENERATIONS as NO_POSITIVE

    from dicache.commands.serve import parse_serve_argv, settings_from_args
    from dicache.server import create_app, load_backend
    from dicache.server.background import BackgroundServer

    torch.set_num_threads(1)
    backend = load_backend(None, "turbo", device="cpu", default_size=(32, 32))
    keyed = settings_from_args(parse_serve_argv([*SERVE_FLAGS, "--api-key", KEY, "--metrics-auth"]))
    plain = settings_from_args(parse_serve_argv(SERVE_FLAGS))
    rows = []
    with BackgroundServer(create_app(backend, keyed)) as a, BackgroundServer(create_app(backend, plain)) as b:
        servers = {"keyed": a, "open": b}
        for i, (name, (server, with_key, examples, config)) in enumerate(SINGLE_PROCESS_RUNS.items()):
            url, key = servers[server].url, (KEY if server == "keyed" else None)
            before = server_counts(url, key)
            folder = out / f"run{i}"
            folder.mkdir()
            run = schemathesis_run(url, folder, KEY if with_key else None, examples, NO_POSITIVE if config else "")
            after = server_counts(url, key)
            rows.append(row("single process", name, run, after, before, generations, answered))
    backend.close()
    return rows


def fuzz_ray(out: pathlib.Path) -> list[dict]:
    """The Ray Serve HTTP path as `tests/test_ray_serve.py` fuzzes it: `dicache serve --ray` (one replica behind Serve's
    proxy, a local Ray cluster) with the fuzz's bounds and an API key, fuzzed with and without the key, fewer cases."""
    import re
    import signal
    import socket
    import subprocess
    import time

    from schema_fuzz import KEY, RAY_FUZZ_COVERAGE, SERVE_FLAGS, answered, generations, schemathesis_run, server_counts

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dicache.cli", "serve", "--ray", "--replicas", "1", "--device", "cpu"]
    cmd += ["--torch-threads", "1", "--variant", "turbo", "--port", str(port), *SERVE_FLAGS, "--api-key", KEY]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    log = (out / "ray-serve.log").open("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        deadline = time.monotonic() + 300
        while not re.search(r"dicache on Ray Serve: 1 replica\(s\) at ", pathlib.Path(log.name).read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"dicache serve --ray did not start; its output:\n{pathlib.Path(log.name).read_text()}"
                )
            time.sleep(0.5)
        for i, (name, key, config) in enumerate(
            (("with the API key", KEY, RAY_FUZZ_COVERAGE), ("without the key", None, ""))
        ):
            before = server_counts(url, KEY)
            folder = out / f"ray{i}"
            folder.mkdir()
            run = schemathesis_run(url, folder, key, max_examples=10, config=config)
            rows.append(row("Ray Serve", name, run, server_counts(url, KEY), before, generations, answered))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        log.close()
    return rows


def row(server: str, name: str, run, after: dict, before: dict, generations, answered) -> dict:
    report = run.report
    clean = report["exit_code"] == 0 and not report["failures"] and not report["errors"] and report["complete"]
    return {
        "server": server,
        "run": name,
        "requests": run.cases,
        "images": int(generations(after, "ok") - generations(before, "ok")),
        "5xx": int(answered(after, "5") - answered(before, "5")),
        "failed generations": int(generations(after, "failed") - generations(before, "failed")),
        "all checks passed": "yes" if clean else "**no**",
        "CPU s": f"{run.cpu_s:.0f}",
        "wall s": f"{run.wall_s:.0f}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ray", action="store_true", help="also fuzz the Ray Serve HTTP path (needs the ray extra)")
    parser.add_argument("--results", default=None, help="publish the section to this results page")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dicache-fuzz-") as tmp:
        rows = fuzz_single_process(pathlib.Path(tmp))
        if args.ray:
            rows += fuzz_ray(pathlib.Path(tmp))
    total = sum(r["requests"] for r in rows)
    bad = sum(r["5xx"] + r["failed generations"] for r in rows) + sum(r["all checks passed"] != "yes" for r in rows)
    load = os.getloadavg()[0]
    text = "\n".join(
        [
            "\n## Schema fuzzing: the API fuzzed from its own OpenAPI schema\n",
            f"Command: `{command_line('bench_schema_fuzz.py', argv)}`  ",
            f"Machine: {platform.machine()} CPU, {os.cpu_count()} cores (1-min load {load:.1f}); the embedded Turbo "
            "student; schemathesis, all checks, all phases, derandomised (the same requests every run)\n",
            *markdown_table(rows),
            "",
            f"**{total} requests generated; {'0 problems' if not bad else f'{bad} PROBLEMS'}** (5xx answers, failed "
            "generations, runs whose checks did not all pass; a hang is an error of its run).",
            "",
        ]
    )
    publish(text, args.results)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
