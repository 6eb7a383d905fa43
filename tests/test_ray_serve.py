"""`dicache serve --ray` for real: a local Ray cluster (2 CPUs, loopback), 2 CPU replicas of the embedded checkpoint.

- a request gives the same image bytes (and cache statistics) through Ray Serve as through a live single-process
  server of the same pipeline and settings;
- under a concurrent load both replicas serve, and one scrape of `/metrics` counts each replica's generations;
- a replica killed mid-load: its in-flight requests get a clear OpenAI-shaped 503 (code `replica_unavailable`,
  Retry-After), the other replica's succeed, Serve starts a replacement that then serves, and every request ends
  within its client timeout;
- a replica holding its model over 2 processes (Ulysses 2, gloo, a placement group of 2 CPU bundles) gives the
  single-process bytes and cache decisions too.

Skipped when Ray is not installed (`pip install 'dicache[ray]'`; the test extra installs it).
"""

from __future__ import annotations

import collections
import os
import pathlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import pipeline_source, wait_until

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from dicache.config import CacheConfig  # noqa: E402
from dicache.server import ServerSettings, create_app, load_backend  # noqa: E402
from dicache.server.background import BackgroundServer  # noqa: E402
from dicache.server.ray_proxy import CALLBACK_ENV, CALLBACK_PATH  # noqa: E402
from dicache.server.ray_serve import (  # noqa: E402
    APP_NAME,
    DEPLOYMENT_NAME,
    REPLICA_HEADER,
    RayServeOptions,
    ReplicaSpec,
    build_application,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420), pytest.mark.usefixtures("one_torch_thread")]

ROOT = pathlib.Path(__file__).resolve().parents[1]
GENERATIONS = "/v1/images/generations"
CACHE = CacheConfig.from_env(
    {"SGLANG_CACHE_DIT_ENABLED": "true", "SGLANG_CACHE_DIT_WARMUP": "2", "SGLANG_CACHE_DIT_RDT": "0.5"}
)
SETTINGS = ServerSettings(max_side=64, max_n=2, max_steps=40, max_queue=8, request_timeout_s=120)
CLIENT_TIMEOUT = 120.0
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


@pytest.fixture(scope="module")
def cluster():
    """A local 2-CPU Ray cluster with Serve's proxy on a loopback port (our proxy middleware installed)."""
    env = {
        CALLBACK_ENV: CALLBACK_PATH,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_memory_monitor_refresh_ms": "0",  # never let Ray's OOM killer pick a replica on a small CI box
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)  # Ray's processes inherit them: the replicas import this checkout
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port, "request_timeout_s": CLIENT_TIMEOUT})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_url(cluster, model_source):
    """Two CPU replicas (1 CPU each) of the same app as the single-process server."""
    spec = ReplicaSpec(
        settings=SETTINGS, model=model_source, device="cpu", cache_config=CACHE, torch_threads=1, metrics_period_s=0.5
    )
    serve.run(build_application(spec, RayServeOptions(replicas=2)), name=APP_NAME, route_prefix="/")
    return cluster


@pytest.fixture(scope="module")
def single_url(model_source):
    """The single-process server with the same pipeline and settings, in this process."""
    backend = load_backend(model_source, device="cpu", cache_config=CACHE)
    with BackgroundServer(create_app(backend, SETTINGS)) as server:
        yield server.url
    backend.close()


def _post(url: str, body: dict, timeout: float = CLIENT_TIMEOUT) -> httpx.Response:
    return httpx.post(url + GENERATIONS, json=body, timeout=timeout)


def _replica_counts(url: str) -> dict[str, float]:
    """`dicache_generations_total{outcome="ok"}` per replica, from one scrape of /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        s.labels["replica"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "dicache_generations_total" and s.labels.get("outcome") == "ok"
    }


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
    time.sleep(1.5)  # let every replica post its latest figures (period 0.5 s)
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

    wait_until(counted, timeout=20, what=f"/metrics to count {dict(served)} generations per replica")


def test_a_replica_killed_mid_load_fails_only_its_requests_and_comes_back(ray_url):
    replicas = _replica_ids(ray_url)
    assert len(replicas) == 2
    victim = sorted(replicas)[0]
    bodies = [dict(BODIES["turbo"], seed=200 + i, num_inference_steps=16) for i in range(8)]
    started = time.monotonic()
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(_post, ray_url, body, 90.0) for body in bodies]
        time.sleep(1.5)  # every request is routed by now: each replica has one generating, the rest queued
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
    wait_until(lambda: victim not in _replica_counts(ray_url), timeout=20, what="the killed replica leaving /metrics")


# ---------------------------------------------------------------------------------------------- model groups
def test_ulysses_group_replica_gives_the_single_process_bytes(cluster, ray_url, single_url, model_source):
    """Last: it replaces the 2-replica app (the cluster has 2 CPUs) with one replica split over 2 processes."""
    serve.delete(APP_NAME)
    spec = ReplicaSpec(
        settings=SETTINGS, model=model_source, device="cpu", cache_config=CACHE, torch_threads=1, ulysses_degree=2
    )
    serve.run(build_application(spec, RayServeOptions(replicas=1)), name="dicache-sp", route_prefix="/")
    try:
        for case in ("turbo", "cfg_overrides"):
            ours, theirs = _post(cluster, BODIES[case]), _post(single_url, BODIES[case])
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
