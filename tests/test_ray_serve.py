"""`dicache serve --ray` for real: the command started as a user would, on a local Ray cluster (loopback), with 2
CPU replicas of the embedded checkpoint.

- a request gives the same image bytes (and cache statistics) through Ray Serve as through a live single-process
  server of the same pipeline and settings; bad requests get the same 400s;
- under a concurrent load both replicas serve, and one scrape of `/metrics` counts each replica's generations;
- a replica killed mid-load: its in-flight requests get a clear OpenAI-shaped 503 (code `replica_unavailable`,
  Retry-After), the other replica's succeed, Serve starts a replacement that then serves, and every request ends
  within its client timeout;
- a replica holding its model over 2 processes (Ulysses 2, gloo, a placement group of 2 CPU bundles) gives the
  single-process bytes and cache decisions too;
- requests generated from the app's own /openapi.json (`schema_fuzz`, as tests/test_schema_fuzz.py, fewer cases)
  pass every schemathesis check through Serve's proxy, with and without the API key;
- SIGTERM stops the command with exit status 0;
- SIGTERM with requests in flight drains every replica as the single-process server drains: a new request and
  `/health` get 503 + Retry-After (OpenAI shape, not Serve's 404), the accepted requests get 200 or, past a short
  `--drain-timeout` (or after a second SIGTERM), 503, and the command exits 0 (a second command, started once the
  first one stopped).

The test process joins the command's cluster as a second Ray driver to kill a replica and deploy the split one.
Skipped when Ray is not installed (`pip install 'dicache[ray]'`; the test extra installs it).
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from schema_fuzz import KEY as FUZZ_KEY
from schema_fuzz import RAY_FUZZ_COVERAGE, answered, generations, schemathesis_run, server_counts
from schema_fuzz import SERVE_FLAGS as FUZZ_FLAGS
from server_helpers import pipeline_source, wait_until

# Ray reads its authentication mode once, when imported; a driver joining a cluster by address must say "token"
# itself (the command's local cluster turns token authentication on, Ray's default, and writes ~/.ray/auth_token).
os.environ.setdefault("RAY_AUTH_MODE", "token")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from dicache.commands.serve import parse_serve_argv, settings_from_args  # noqa: E402
from dicache.server import create_app, load_backend  # noqa: E402
from dicache.server.background import BackgroundServer  # noqa: E402
from dicache.server.ray.deployment import APP_NAME, DEPLOYMENT_NAME, REPLICA_HEADER, build_application  # noqa: E402
from dicache.server.ray.options import RayServeOptions  # noqa: E402
from dicache.server.ray.spec import ReplicaSpec  # noqa: E402
from dicache.settings.cache_config import CacheConfig  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420), pytest.mark.usefixtures("one_torch_thread")]

ROOT = pathlib.Path(__file__).resolve().parents[1]
GENERATIONS = "/v1/images/generations"
CACHE_ENV = {"SGLANG_CACHE_DIT_ENABLED": "true", "SGLANG_CACHE_DIT_WARMUP": "2", "SGLANG_CACHE_DIT_RDT": "0.5"}
CACHE = CacheConfig.from_env(CACHE_ENV)
SETTINGS_FLAGS = ["--max-side", "64", "--max-n", "2", "--max-steps", "200", "--max-queue", "8", "--timeout", "120"]
SETTINGS = settings_from_args(parse_serve_argv(SETTINGS_FLAGS))  # what the command's replicas serve with
CLIENT_TIMEOUT = 120.0
START_TIMEOUT = 300.0
METRICS_FRESH_S = 2 * ReplicaSpec.metrics_period_s + 0.5  # every replica has posted its latest figures by then
BODIES = {
    "turbo": dict(prompt="a red fox", size="64x64", num_inference_steps=6, guidance_scale=1.0, seed=1),
    "cfg_overrides": dict(
        prompt="a blue car", negative_prompt="sun", size="32x48", n=2, num_inference_steps=8, guidance_scale=4.5,
        seed=2, cache_dit_params={"residual_diff_threshold": 0.8, "enable_taylorseer": True},
    ),
    "uncached": dict(prompt="a green tree", size="32x32", num_inference_steps=5, enable_cache=False, seed=3),
}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_source(tmp_path_factory):
    return pipeline_source(tmp_path_factory.mktemp("krea2"))


class Command:
    """`dicache serve --ray ...` running in a subprocess, its output in a file."""

    def __init__(self, args: list[str], log: pathlib.Path, env: dict[str, str]) -> None:
        self.log = log
        with open(log, "wb") as out:
            cmd = [sys.executable, "-m", "dicache.cli", "serve", "--ray", *args]
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.output())
            if found:
                return found
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} from dicache serve --ray; output:\n{self.output()[-4000:]}")
            time.sleep(0.25)

    def stop(self, timeout: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise


def _command_env() -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_CACHE_DIT_", "RAY_ADDRESS"))},
        **CACHE_ENV,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_memory_monitor_refresh_ms": "0",  # never let Ray's OOM killer pick a replica on a small CI box
        "RAY_AUTH_MODE": "token",  # Ray's default for a local cluster, said explicitly: this process joins with it
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),  # this checkout
    }


def _command_args(model_source, port: int, *extra: str) -> list[str]:
    args = ["--replicas", "2", "--device", "cpu", "--torch-threads", "1", "--port", str(port), *SETTINGS_FLAGS, *extra]
    return args + (["--model", model_source] if model_source is not None else [])


@pytest.fixture(scope="module")
def command(model_source, tmp_path_factory):
    """`dicache serve --ray --replicas 2` on CPU (1 CPU and 1 torch thread per replica); this process joins its Ray
    cluster as a driver."""
    port = _free_port()
    cmd = Command(_command_args(model_source, port), tmp_path_factory.mktemp("ray") / "serve.log", _command_env())
    try:
        address = cmd.wait_for(r"Ray cluster at (\S+)", START_TIMEOUT).group(1)
        cmd.wait_for(r"dicache on Ray Serve: 2 replica\(s\) at ", START_TIMEOUT)
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
        cmd.url = f"http://127.0.0.1:{port}"
        yield cmd
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cmd.stop()


@pytest.fixture(scope="module")
def ray_url(command):
    return command.url


@pytest.fixture(scope="module")
def single_url(model_source):
    """The single-process server with the same pipeline and settings, in this process."""
    backend = load_backend(model_source, device="cpu", cache_config=CACHE)
    with BackgroundServer(create_app(backend, SETTINGS)) as server:
        yield server.url
    backend.close()


def _post(url: str, body: dict, timeout: float = CLIENT_TIMEOUT) -> httpx.Response:
    return httpx.post(url + GENERATIONS, json=body, timeout=timeout)


def _replica_samples(url: str, name: str, **labels: str) -> dict[str, float]:
    """Sample `name` (with `labels`) per replica, from one scrape of /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        s.labels["replica"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    }


def _replica_counts(url: str, outcome: str = "ok") -> dict[str, float]:
    """`dicache_generations_total{outcome=...}` per replica, from one scrape of /metrics."""
    return _replica_samples(url, "dicache_generations_total", outcome=outcome)


def _replica_ids(url: str, count: int = 6) -> set[str]:
    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(lambda i: _post(url, dict(BODIES["turbo"], seed=100 + i)), range(count)))
    assert all(a.status_code == 200 for a in answers), [a.text[:200] for a in answers]
    return {a.headers[REPLICA_HEADER] for a in answers}


# ---------------------------------------------------------------------------------------------- same bytes
@pytest.mark.parametrize("case", list(BODIES))
def test_same_image_bytes_as_the_single_process_server(ray_url, single_url, case):
    ours, theirs = _post(ray_url, BODIES[case]), _post(single_url, BODIES[case])
    assert ours.status_code == theirs.status_code == 200, (ours.text[:300], theirs.text[:300])
    a, b = ours.json(), theirs.json()
    assert [d["b64_json"] for d in a["data"]] == [d["b64_json"] for d in b["data"]]  # PNG bytes, bit for bit
    assert [d["sha256"] for d in a["data"]] == [d["sha256"] for d in b["data"]]  # float32 output, bit for bit
    assert a["cache_stats"] == b["cache_stats"] and a["generation"] == b["generation"]
    assert ours.headers[REPLICA_HEADER] and REPLICA_HEADER not in theirs.headers


def test_openai_client_and_error_contract_through_ray(ray_url, single_url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=ray_url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT)
    assert [m.id for m in client.models.list()] == ["krea-2"]
    image = client.images.generate(
        model="krea-2",
        prompt="a red fox",
        size="64x64",
        response_format="b64_json",
        extra_body={"seed": 1, "num_inference_steps": 6, "guidance_scale": 1.0},
    )
    assert image.data[0].b64_json == _post(single_url, BODIES["turbo"]).json()["data"][0]["b64_json"]
    for body in ({"prompt": "x", "size": "65x64"}, {"prompt": "x", "n": 9}, {"prompt": "x", "bogus": 1}):
        ours, theirs = _post(ray_url, body), _post(single_url, body)
        assert ours.status_code == theirs.status_code == 400
        assert ours.json() == theirs.json()


# ---------------------------------------------------------------------------------------------- load
def test_both_replicas_serve_a_concurrent_load_and_metrics_count_each(ray_url):
    time.sleep(METRICS_FRESH_S)
    before = _replica_counts(ray_url)
    bodies = [dict(BODIES["turbo"], seed=10 + i, num_inference_steps=4) for i in range(12)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda b: _post(ray_url, b), bodies))
    assert [a.status_code for a in answers] == [200] * len(bodies)
    served = collections.Counter(a.headers[REPLICA_HEADER] for a in answers)
    assert len(served) == 2, served  # both replicas took part

    def counted() -> bool:  # one scrape shows every replica's generations
        after = _replica_counts(ray_url)
        return all(after.get(r, 0) - before.get(r, 0) == n for r, n in served.items())

    wait_until(counted, timeout=60, what=f"/metrics to count {dict(served)} generations per replica")


def test_a_client_that_goes_away_stops_its_generation(ray_url):
    """Serve cancels the replica's handler when the client disconnects; the generation must stop, not run on."""
    time.sleep(METRICS_FRESH_S)
    before = sum(_replica_counts(ray_url, "stopped").values())
    # 400 uncached transformer calls (200 steps with CFG): far past the client's 1.5 s even on an idle machine (80
    # calls finished within it there)
    long = dict(BODIES["turbo"], seed=77, num_inference_steps=200, guidance_scale=4.5, enable_cache=False)
    with pytest.raises(httpx.TimeoutException):
        _post(ray_url, long, timeout=1.5)
    wait_until(
        lambda: sum(_replica_counts(ray_url, "stopped").values()) == before + 1,
        timeout=30,
        what="the abandoned generation to be counted as stopped",
    )


def test_a_replica_killed_mid_load_fails_only_its_requests_and_comes_back(ray_url):
    replicas = _replica_ids(ray_url)
    assert len(replicas) == 2
    # 80 uncached transformer calls each (seconds on one CPU thread), so the victim still holds work when killed
    long = dict(BODIES["turbo"], num_inference_steps=40, guidance_scale=4.5, enable_cache=False)
    bodies = [dict(long, seed=200 + i) for i in range(8)]
    seen: list[dict[str, tuple[float, float]]] = []  # (running, queued) per replica, each scrape

    def holding_two() -> str | None:
        """The replica seen with two long requests in flight, more work than the metrics lag behind: with --workers 2
        (the default) both generating, with 1 one generating and one queued. Whichever replica it is: the router
        need not split 8 requests evenly."""
        running = _replica_samples(ray_url, "dicache_generations_running")
        queued = _replica_samples(ray_url, "dicache_queue_depth")
        seen.append({r: (running.get(r, 0), queued.get(r, 0)) for r in replicas})
        return next((r for r, (run, wait) in seen[-1].items() if run >= 1 and run + wait >= 2), None)

    started = time.monotonic()
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(_post, ray_url, body, 90.0) for body in bodies]
        deadline, victim = time.monotonic() + 60, None
        while victim is None:
            assert time.monotonic() < deadline, f"no replica held two requests; (running, queued) seen: {seen[-5:]}"
            time.sleep(0.25)  # a scrape goes through the proxy: polling it hard slows the replicas on 2 cores
            victim = holding_two()
        assert not all(f.done() for f in futures)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{victim}", namespace="serve"))
        answers = [f.result(timeout=120) for f in futures]  # nothing hangs: every request is answered
    assert time.monotonic() - started < 120

    failed = [a for a in answers if a.status_code != 200]
    ok = [a for a in answers if a.status_code == 200]
    assert failed and ok, [a.status_code for a in answers]
    assert {a.headers[REPLICA_HEADER] for a in ok} - {victim}  # the surviving replica's requests succeeded
    for answer in failed:  # the killed replica's in-flight requests: a clear, retryable error
        assert answer.status_code == 503, answer.text[:300]
        error = answer.json()["error"]
        assert error["code"] == "replica_unavailable" and "replica" in error["message"], error
        assert answer.headers["retry-after"] == "1"

    def replaced() -> bool:  # Serve starts a replacement, and it serves
        return len(_replica_ids(ray_url, 4) - {victim}) == 2

    wait_until(replaced, timeout=120, what="a replacement replica serving next to the survivor")
    status = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
    assert status.replica_states.get("RUNNING") == 2
    wait_until(lambda: victim not in _replica_counts(ray_url), timeout=40, what="the killed replica leaving /metrics")


# ---------------------------------------------------------------------------------------------- model groups
def test_ulysses_group_replica_gives_the_single_process_bytes(ray_url, single_url, model_source):
    """Last: it replaces the 2-replica app (the cluster has 2 CPUs) with one replica split over 2 processes."""
    serve.delete(APP_NAME)
    spec = ReplicaSpec(
        settings=SETTINGS, model=model_source, device="cpu", cache_config=CACHE, torch_threads=1, ulysses_degree=2
    )
    serve.run(build_application(spec, RayServeOptions(replicas=1)), name="dicache-sp", route_prefix="/")
    try:
        for case in ("turbo", "cfg_overrides"):
            ours, theirs = _post(ray_url, BODIES[case]), _post(single_url, BODIES[case])
            assert ours.status_code == theirs.status_code == 200, ours.text[:300]
            assert [d["b64_json"] for d in ours.json()["data"]] == [d["b64_json"] for d in theirs.json()["data"]]
            for branch, stats in theirs.json()["cache_stats"]["branches"].items():  # same cache decisions; the
                mine = ours.json()["cache_stats"]["branches"][branch]  # diffs, summed over ranks, may round apart
                assert (mine["computed_steps"], mine["cached_steps"]) == (
                    stats["computed_steps"],
                    stats["cached_steps"],
                )
    finally:
        serve.delete("dicache-sp")


RAY_FUZZ_CASES = 1000
"""Requests the Ray Serve fuzz generates, at least (two derandomised runs: with the API key and without)."""


def test_the_ray_serve_http_path_fuzzed_from_its_own_schema(ray_url, model_source, tmp_path):
    """One replica with the schema fuzz's bounds and an API key, behind Serve's proxy (with its error middleware),
    fuzzed as tests/test_schema_fuzz.py fuzzes the single-process server, with fewer cases: with the key and without
    it. After the group test, which removed the command's app (the cluster has 2 CPUs); removed here too when run
    alone."""
    serve.delete(APP_NAME)
    settings = settings_from_args(parse_serve_argv([*FUZZ_FLAGS, "--api-key", FUZZ_KEY]))
    spec = ReplicaSpec(settings=settings, model=model_source, variant="turbo", device="cpu", torch_threads=1)
    serve.run(build_application(spec, RayServeOptions(replicas=1)), name="dicache-fuzz", route_prefix="/")
    try:
        cases = {}
        for name, key, config in (("key", FUZZ_KEY, RAY_FUZZ_COVERAGE), ("no_key", None, "")):
            (tmp_path / name).mkdir()
            run = schemathesis_run(ray_url, tmp_path / name, key, max_examples=10, config=config)
            run.check(f"ray {name}")
            cases[name] = run.cases
            print(f"ray schema fuzz {name}: {run.cases} cases, {run.wall_s:.1f} s wall, {run.cpu_s:.1f} s CPU")
        assert sum(cases.values()) >= RAY_FUZZ_CASES, cases
        counts = server_counts(ray_url, FUZZ_KEY)
        assert answered(counts, "5") == 0 and generations(counts, "failed") == 0
        assert generations(counts, "ok") >= 1  # schema-valid requests went through Serve to the replica
        headers = {"Authorization": f"Bearer {FUZZ_KEY}"}
        assert httpx.get(ray_url + "/health", timeout=30).json() == {"status": "ok"}
        body = {"prompt": "a red fox", "size": "32x32", "num_inference_steps": 2, "seed": 1}
        answer = httpx.post(ray_url + GENERATIONS, json=body, headers=headers, timeout=CLIENT_TIMEOUT)
        assert answer.status_code == 200 and answer.json()["data"][0]["b64_json"], answer.text[:300]
    finally:
        serve.delete("dicache-fuzz")


def test_sigterm_stops_the_command_with_status_0(command):
    ray.shutdown()  # this process leaves the cluster first: the command owns it
    assert command.stop() == 0, command.output()[-4000:]
    assert "stopping: every replica finishes its requests first" in command.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(command.url + "/health", timeout=5)


@pytest.mark.parametrize("how", ["grace_period", "second_signal"])
def test_sigterm_drains_every_replica_like_the_single_process_server(model_source, tmp_path, how):
    """Last, after the module's command stopped (the machine holds one 2-CPU cluster at a time). `grace_period`: a
    4 s --drain-timeout runs out; `second_signal`: a 600 s one is cut short by a second SIGTERM."""
    port = _free_port()
    grace = "4" if how == "grace_period" else "600"
    # --max-queue 32: Serve's router holds the 12 requests arriving at once while it assigns them (with 8 it may drop
    # some as backpressure, 429, before any drain)
    args = _command_args(model_source, port, "--drain-timeout", grace, "--max-queue", "32")
    cmd = Command(args, tmp_path / "serve.log", _command_env())
    try:
        cmd.wait_for(r"dicache on Ray Serve: 2 replica\(s\) at ", START_TIMEOUT)
        url = f"http://127.0.0.1:{port}"
        assert len(_replica_ids(url, 4)) == 2
        # 80 uncached transformer calls each (over a second), 6 per replica: more than the drain lets finish
        long = dict(BODIES["turbo"], num_inference_steps=40, guidance_scale=4.5, enable_cache=False)
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(_post, url, dict(long, seed=300 + i), 90.0) for i in range(12)]

            def both_generating() -> bool:  # each replica runs up to --workers (2) generations at once
                running = _replica_samples(url, "dicache_generations_running").values()
                return len(running) == 2 and min(running) >= 1.0

            wait_until(both_generating, timeout=60, what="both replicas to be generating")
            cmd.proc.send_signal(signal.SIGTERM)
            cmd.wait_for(r"draining: every replica answers new requests 503", 30)
            late = _post(url, BODIES["turbo"], timeout=30)  # a new request during the drain
            assert late.status_code == 503, (late.status_code, late.text[:300])  # not Serve's 404
            assert late.headers["retry-after"] == "5" and late.headers[REPLICA_HEADER]
            error = late.json()["error"]
            assert error["code"] == "shutting_down" and error["type"] == "server_unavailable", error
            health = httpx.get(url + "/health", timeout=30)
            assert (health.status_code, health.json()) == (503, {"status": "draining"})
            if how == "second_signal":
                hurried = time.monotonic()
                cmd.proc.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=120) for f in futures]  # nothing hangs
        codes = collections.Counter(a.status_code for a in answers)
        assert set(codes) <= {200, 503} and codes[503], codes  # the drain cannot hold 6 long generations per replica
        for answer in answers:
            if answer.status_code == 503:  # the drain's answer to what could not finish
                assert answer.json()["error"]["code"] == "shutting_down" and answer.headers["retry-after"] == "5"
        assert cmd.proc.wait(90) == 0, cmd.output()[-4000:]
        assert "drained: every replica answered its requests" in cmd.output(), cmd.output()[-4000:]
        if how == "second_signal":
            assert time.monotonic() - hurried < 60  # not the 600 s grace period
    finally:
        cmd.stop()


# ---------------------------------------------------------------------------------------------- a busy machine
@pytest.fixture
def every_core_busy():
    """One busy-loop process per core for the test's duration (a node also loading weights, a noisy neighbour)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield len(loops)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def test_serve_ray_starts_and_serves_with_every_core_busy(model_source, tmp_path, every_core_busy):
    """Last, as the other commands (one cluster at a time). With Ray's own timeouts the command failed here: Serve
    gave its proxy 3 × 5 s to start, and the proxy's start imported torch through `dicache`."""
    port = _free_port()
    cmd = Command(_command_args(model_source, port, "--replicas", "1"), tmp_path / "serve.log", _command_env())
    try:
        cmd.wait_for(r"dicache on Ray Serve: 1 replica\(s\) at ", START_TIMEOUT)
        answer = _post(f"http://127.0.0.1:{port}", dict(BODIES["turbo"], num_inference_steps=2))
        assert answer.status_code == 200, answer.text[:300]
        assert answer.json()["data"][0]["b64_json"] and answer.headers[REPLICA_HEADER]
        assert cmd.stop() == 0, cmd.output()[-4000:]
    finally:
        cmd.stop()


def test_a_start_up_timeout_is_one_line_naming_the_option_with_exit_status_1(model_source, tmp_path):
    """A proxy given less time than any process needs to start: Serve's controller gives up on it, and the command
    says so in one line (no traceback) and exits 1."""
    cmd = Command(
        _command_args(model_source, _free_port(), "--replicas", "1", "--proxy-start-timeout", "0.03"),
        tmp_path / "serve.log",
        _command_env(),
    )
    try:
        assert cmd.proc.wait(START_TIMEOUT) == 1, cmd.output()[-4000:]
    finally:
        cmd.stop()
    output = cmd.output()
    # the command's own output has no traceback (Ray's worker logs, forwarded with a "(ServeController pid=...)"
    # prefix, may show one from its controller, as they may show its warnings)
    assert not [line for line in output.splitlines() if line.startswith(("Traceback", "  File "))], output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("dicache serve: error:")]
    assert len(errors) == 1, output[-4000:]
    assert errors[0].startswith(
        "dicache serve: error: Ray Serve's HTTP proxy did not start within --proxy-start-timeout=0.03 s ("
    ), errors
    assert errors[0].endswith("on a busy machine, raise --proxy-start-timeout"), errors
    assert "dicache on Ray Serve" not in output
