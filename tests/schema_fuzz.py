"""Helpers of the schema fuzz tests (`test_schema_fuzz.py`, and the Ray Serve one in `test_ray_serve.py`): the server
bounds they share, and one `schemathesis run` with every check, derandomised, its report read back.

The fuzzer runs as its command (`python -m schemathesis.cli run`), with `fuzz_hooks` (this folder) loaded through
`SCHEMATHESIS_HOOKS`: the same run a user gets from the command line.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest
from server_helpers import metrics_text_to_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEY = "fuzz-key-0123456789abcdef"
SERVE_FLAGS = [
    "--docs",
    "--max-side", "32",
    "--max-steps", "2",
    "--max-n", "2",
    "--max-prompt-chars", "64",
    "--timeout", "30",
]  # fmt: skip
"""`dicache serve` options of a fuzzed server: every generation small (32 px sides, 2 steps, 2 images, 64-character
prompts) and answered within 30 s; its schema states these bounds, so each schema-valid request is a cheap image."""
CLIENT_TIMEOUT_S = 45.0
"""Per request: past the server's own --timeout (30 s, then it answers 504), so a request still unanswered is a
hang, which schemathesis reports as an error."""
NO_POSITIVE_GENERATIONS = """
[[operations]]
include-path = "/v1/images/generations"
generation.mode = "negative"
generation.deterministic = true
"""
"""A run configuration (schemathesis.toml): the generation endpoint gets schema-invalid requests only (each
schema-valid one is an image; a run that has sent them elsewhere need not pay for them twice)."""

RAY_FUZZ_COVERAGE = """
[[operations]]
include-path = "/v1/images/generations"
phases.coverage.generation.mode = "negative"
phases.coverage.generation.deterministic = true
"""
"""The Ray fuzz's configuration: the generation endpoint's coverage phase sends schema-invalid requests only (its
schema-valid ones, 200-odd images, go through the single-process fuzz, tests/test_schema_fuzz.py)."""


@dataclass
class FuzzRun:
    report: dict
    output: str
    wall_s: float
    cpu_s: float

    @property
    def cases(self) -> int:
        return self.report["test_cases"]["generated"]

    def check(self, name: str) -> None:
        """Fail with schemathesis's own account unless every check passed on every case, with no error (a request
        unanswered within `CLIENT_TIMEOUT_S` is one) and every operation tested."""
        report = self.report
        if report["exit_code"] != 0 or report["failures"] or report["errors"] or not report["complete"]:
            pytest.fail(f"schema fuzz run {name!r} found problems:\n{self.output[-12000:]}")
        operations = report["operations"]
        assert operations["tested"] == operations["total"] and not operations["skipped"], (name, operations)


def schemathesis_run(
    url: str, out: pathlib.Path, key: str | None = None, max_examples: int = 40, config: str = ""
) -> FuzzRun:
    """`schemathesis run` on `url`'s `/openapi.json`: all phases (schema examples, coverage, fuzzing with
    `max_examples` per operation, stateful), every check, derandomised, the API key `key` sent if given, `config`
    as its schemathesis.toml; files under `out`."""
    report = out / "report.json"
    (out / "schemathesis.toml").write_text(config)
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(out / "schemathesis.toml"),
        "run", f"{url}/openapi.json",
        "--checks", "all",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--generation-deterministic",
        "--max-examples", str(max_examples),
        "--request-timeout", str(CLIENT_TIMEOUT_S),
        "--workers", "1",
        "--continue-on-failure",
        "--no-color",
        "--report", "json",
        "--report-json-path", str(report),
    ]  # fmt: skip
    if key is not None:
        cmd += ["--header", f"Authorization: Bearer {key}"]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "fuzz_hooks",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
    }
    started, cpu = time.monotonic(), cpu_seconds()
    proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=480)
    output = proc.stdout + proc.stderr
    assert report.exists(), output[-6000:]
    return FuzzRun(json.loads(report.read_text()), output, time.monotonic() - started, cpu_seconds() - cpu)


def cpu_seconds() -> float:
    """CPU seconds of this process (in-process servers run in it) and of its finished children (the fuzzer)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def server_counts(url: str, key: str | None = None) -> dict[tuple[str, tuple], float]:
    """The server's own metrics: {(sample, labels): value}."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return metrics_text_to_dict(httpx.get(url + "/metrics", headers=headers, timeout=30).text)


def answered(counts: dict[tuple[str, tuple], float], status_class: str) -> float:
    """Requests answered with a status in `status_class` ("2", "4", "5"), summed over endpoints (and replicas)."""
    return sum(
        value
        for (name, labels), value in counts.items()
        if name == "dicache_http_requests_total" and dict(labels)["status"].startswith(status_class)
    )


def generations(counts: dict[tuple[str, tuple], float], outcome: str) -> float:
    """`dicache_generations_total{outcome=...}`, summed over replicas."""
    return sum(
        value
        for (name, labels), value in counts.items()
        if name == "dicache_generations_total" and dict(labels).get("outcome") == outcome
    )
