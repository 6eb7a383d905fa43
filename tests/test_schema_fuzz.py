"""The API fuzzed from its own schema: requests generated from the server's `/openapi.json` by schemathesis (on
hypothesis), every check it has, against the server on the embedded tiny model on the CPU.

The server runs with `dicache serve` options that keep generations cheap and bounded (`SERVE_FLAGS`: 32 px sides, 2
steps, 2 images, 64-character prompts, a 30 s request timeout); its schema states those bounds, so every request
the fuzzer calls valid is a real generation. Three runs, each all four of schemathesis's phases (schema examples,
coverage of every boundary and every undeclared method, fuzzing, stateful links), derandomised (the same cases every
run): a server with an API key fuzzed with the key and without it (every `/v1/*` answer is then a 401), and a server
without a key. Checks: all of schemathesis's (no 5xx; status codes, content types, headers and bodies as
documented; schema-valid data accepted, schema-invalid data refused; 405 with `Allow`; authentication enforced) plus
`fuzz_hooks.openai_error_shape` (every error in OpenAI's shape, a 400 naming its field); no request unanswered
within the client's timeout (a hang is an error in the report). Afterwards the servers still answer `/health` and a
normal generation, and their own metrics count no 5xx and no failed generation.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import time

import httpx
import pytest
from server_helpers import backend_with_env, decode_png, metrics_text_to_dict, pipeline_source

from dicache.commands.serve import parse_serve_argv, settings_from_args
from dicache.server import create_app
from dicache.server.background import BackgroundServer

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

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
CLIENT_TIMEOUT_S = 45.0
"""Per request: past the server's own --timeout (30 s, after which it answers 504), so an unanswered request is a
hang, reported as an error by schemathesis."""
POSITIVE_ELSEWHERE = """
[[operations]]
include-path = "/v1/images/generations"
generation.mode = "negative"
generation.deterministic = true
"""
"""Run configuration: the open server's generation endpoint gets schema-invalid requests only (the keyed run with
the key has sent it the schema-valid ones, each an image; the two servers differ only in the key)."""
RUNS = {  # name: (server, send the key, max examples per operation in the fuzzing phase, schemathesis.toml)
    "key": ("keyed", True, 40, ""),
    "no_key": ("keyed", False, 40, ""),
    "open": ("open", False, 40, POSITIVE_ELSEWHERE),
}
FUZZ_CASES = 2000
"""Requests generated per run of this module, at least (docs/reliability.md states it); the derandomised runs
generate the same cases every time."""


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """The embedded checkpoint's Turbo student (guidance 1 by default: one text encoding per image), caching off."""
    return backend_with_env(pipeline_source(tmp_path_factory.mktemp("krea2")), {}, variant="turbo")


@pytest.fixture(scope="module")
def servers(backend):
    """The two servers of the module: `keyed` (`--api-key`, `--metrics-auth`) and `open`, with `SERVE_FLAGS`."""
    keyed = settings_from_args(parse_serve_argv([*SERVE_FLAGS, "--api-key", KEY, "--metrics-auth"]))
    plain = settings_from_args(parse_serve_argv(SERVE_FLAGS))
    with BackgroundServer(create_app(backend, keyed)) as a, BackgroundServer(create_app(backend, plain)) as b:
        yield {"keyed": a, "open": b}


def schemathesis_run(
    url: str, out: pathlib.Path, key: str | None, max_examples: int, config: str
) -> tuple[dict, str, float]:
    """`schemathesis run` against `url`'s schema with every check, `fuzz_hooks` and the configuration file text
    `config`: (its JSON report, its output, wall seconds)."""
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
    started, cpu = time.monotonic(), _cpu_seconds()
    proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=480)
    seconds = time.monotonic() - started
    print(f"{url}: {seconds:.1f} s wall, {_cpu_seconds() - cpu:.1f} s CPU (fuzzer and server)")
    output = proc.stdout + proc.stderr
    assert report.exists(), output[-6000:]
    return json.loads(report.read_text()), output, seconds


def _cpu_seconds() -> float:
    """CPU seconds of this process (the servers run in it) and of its finished children (the fuzzer)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def server_counts(server, key: str | None) -> dict[tuple[str, tuple], float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return metrics_text_to_dict(httpx.get(server.url + "/metrics", headers=headers, timeout=30).text)


def answered(counts: dict, status_class: str) -> float:
    """Requests the server answered with a status in `status_class` ("2", "4", "5")."""
    return sum(
        value
        for (name, labels), value in counts.items()
        if name == "dicache_http_requests_total" and dict(labels)["status"].startswith(status_class)
    )


def test_the_api_fuzzed_from_its_own_schema(servers, tmp_path):
    totals, timings, generated_images = {}, {}, {}
    for name, (server_name, with_key, max_examples, config) in RUNS.items():
        server = servers[server_name]
        key = KEY if server_name == "keyed" else None
        before = server_counts(server, key)
        out = tmp_path / name
        out.mkdir()
        report, output, seconds = schemathesis_run(server.url, out, KEY if with_key else None, max_examples, config)
        after = server_counts(server, key)
        if report["exit_code"] != 0 or report["failures"] or report["errors"]:
            pytest.fail(f"schema fuzz run {name!r} found problems:\n{output[-12000:]}")
        assert report["complete"] and report["operations"]["tested"] == report["operations"]["total"] == 7, name
        totals[name], timings[name] = report["test_cases"]["generated"], round(seconds, 1)
        ok = ("dicache_generations_total", (("outcome", "ok"),))
        generated_images[name] = after[ok] - before[ok]
        assert answered(after, "5") == answered(before, "5") == 0, name  # the server's own count: no 5xx answered
        failed = ("dicache_generations_total", (("outcome", "failed"),))
        assert after[failed] == 0, name
    print(f"schema fuzz: {totals} cases, {generated_images} images generated, wall seconds {timings}")
    assert sum(totals.values()) >= FUZZ_CASES, totals
    assert generated_images["key"] >= 100  # the schema-valid requests generate images
    assert generated_images["no_key"] == 0  # every /v1 answer was a 401
    assert generated_images["open"] <= 1  # schema-invalid requests only, but the schema's example

    for server_name, server in servers.items():  # still serving
        key = KEY if server_name == "keyed" else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
        body = {"prompt": "a red fox", "size": "32x32", "num_inference_steps": 2, "seed": 1}
        answer = httpx.post(server.url + "/v1/images/generations", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text[:300]
        assert decode_png(answer.json()["data"][0]["b64_json"]).shape == (32, 32, 3)
