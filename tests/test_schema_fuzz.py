"""The API fuzzed from its own schema: requests generated from the server's `/openapi.json` by schemathesis (on
hypothesis), every check it has, against the server on the embedded tiny model on the CPU.

The servers run with `dicache serve` options that keep generations cheap and bounded (`schema_fuzz.SERVE_FLAGS`);
their schema states those bounds, so every request the fuzzer calls valid is a real image. Three runs, each all four
of schemathesis's phases (schema examples, coverage of every boundary and every undeclared method, fuzzing,
stateful links), derandomised (the same cases every run): a server with an API key fuzzed with the key and without
it (every `/v1/*` answer is then a 401), and a server without a key. Checks: all of schemathesis's (no 5xx; status
codes, content types, headers and bodies as documented; schema-valid data accepted, schema-invalid data refused; 405
with `Allow`; authentication enforced) plus `fuzz_hooks.openai_error_shape` (every error in OpenAI's shape, a 400
naming its field); no request unanswered within the client's timeout (a hang is an error in the report).
Afterwards the servers still answer `/health` and a normal generation, and their own metrics count no 5xx and no
failed generation.
"""

from __future__ import annotations

import httpx
import pytest
from schema_fuzz import (
    KEY,
    NO_POSITIVE_GENERATIONS,
    SERVE_FLAGS,
    answered,
    generations,
    schemathesis_run,
    server_counts,
)
from server_helpers import backend_with_env, decode_png, pipeline_source

from dicache.commands.serve import parse_serve_argv, settings_from_args
from dicache.server import create_app
from dicache.server.background import BackgroundServer

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

RUNS = {  # name: (server, send the key, max examples per operation in the fuzzing phase, schemathesis.toml)
    "key": ("keyed", True, 40, ""),
    "no_key": ("keyed", False, 40, ""),
    # the two servers differ only in the key: the keyed run's schema-valid generations (images) are not repeated
    "open": ("open", False, 40, NO_POSITIVE_GENERATIONS),
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


def test_the_api_fuzzed_from_its_own_schema(servers, tmp_path):
    cases, images, seconds = {}, {}, {}
    for name, (server_name, with_key, max_examples, config) in RUNS.items():
        url = servers[server_name].url
        key = KEY if server_name == "keyed" else None
        before = server_counts(url, key)
        (tmp_path / name).mkdir()
        run = schemathesis_run(url, tmp_path / name, KEY if with_key else None, max_examples, config)
        run.check(name)
        after = server_counts(url, key)
        cases[name], images[name] = run.cases, generations(after, "ok") - generations(before, "ok")
        seconds[name] = (round(run.wall_s, 1), round(run.cpu_s, 1))
        assert answered(after, "5") == 0, name  # the server's own count: no 5xx answered
        assert generations(after, "failed") == 0, name
    print(f"schema fuzz: {cases} cases, {images} images, (wall, CPU) seconds {seconds}")
    assert sum(cases.values()) >= FUZZ_CASES, cases
    assert images["key"] >= 100  # the schema-valid requests generate images
    assert images["no_key"] == 0  # every /v1 answer was a 401
    assert images["open"] <= 1  # schema-invalid requests only, but the schema's example

    for server_name, server in servers.items():  # still serving
        headers = {"Authorization": f"Bearer {KEY}"} if server_name == "keyed" else {}
        assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
        body = {"prompt": "a red fox", "size": "32x32", "num_inference_steps": 2, "seed": 1}
        answer = httpx.post(server.url + "/v1/images/generations", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text[:300]
        assert decode_png(answer.json()["data"][0]["b64_json"]).shape == (32, 32, 3)
