"""`dicache serve` on a network: API key, exposure, connection limits, drain on SIGTERM, option validation (issue 18).

Servers listen on 127.0.0.1 only; every loop is bounded and every server stops by itself.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_helpers import (
    GatedBackend,
    backend_with_env,
    dumps,
    free_port,
    metrics_text_to_dict,
    pipeline_source,
    post_request,
    raw_http,
    wait_until,
)

from dicache.cli import main as cli_main
from dicache.models.krea2.checkpoints import EMBEDDED_CHECKPOINT as EMBEDDED
from dicache.server import ServerSettings, create_app
from dicache.server.background import BackgroundServer
from dicache.server.runner import ConnectionLimits, exposure_warnings

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

GENERATIONS = "/v1/images/generations"
KEY = "sk-test-7f3a9c1e-do-not-log"
TINY = dict(prompt="a red fox", size="16x16", num_inference_steps=2, seed=1)
LONG = dict(prompt="a rocket", size="64x64", num_inference_steps=200, guidance_scale=4.5, seed=0)  # 400 calls


@pytest.fixture(scope="module")
def model_source(tmp_path_factory):
    return pipeline_source(tmp_path_factory.mktemp("krea2"))


@pytest.fixture(scope="module")
def backend(model_source):
    return backend_with_env(model_source, {"SGLANG_CACHE_DIT_ENABLED": "true"})


def info(url: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url + "/v1/server_info", headers=headers).json()


# ---------------------------------------------------------------------------------------------- authentication
class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_api_key_with_the_openai_client(backend):
    """Issue 18 item 5: /v1/* needs the key (401 in OpenAI's shape otherwise); /health stays open; /metrics is open
    unless protected; the key is in no answer and no log line."""
    settings = ServerSettings(api_key=KEY, max_side=64)
    logs = Collect()
    with BackgroundServer(create_app(backend, settings), log_level="debug") as srv:
        loggers = [logging.getLogger(name) for name in ("uvicorn.access", "uvicorn.error", "dicache.server")]
        for logger in loggers:
            logger.addHandler(logs)
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in good.models.list()] == ["krea-2"]
        image = good.images.generate(prompt="a red fox", size="16x16", extra_body={"num_inference_steps": 2})
        assert len(image.data) == 1

        wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY[:-1] + "X", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.images.generate(prompt="a red fox", size="16x16")
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
        assert "invalid API key" in caught.value.body["message"]
        missing = httpx.post(srv.url + GENERATIONS, json=TINY)  # the openai client always sends a key
        assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
        answers = [
            missing,
            httpx.post(srv.url + GENERATIONS, json=TINY, headers={"Authorization": KEY}),  # no "Bearer"
            httpx.post(srv.url + GENERATIONS, json=TINY, headers={"Authorization": "Basic " + KEY}),
            httpx.get(srv.url + "/v1/server_info"),
            httpx.get(srv.url + "/v1/models/krea-2", headers={"Authorization": "Bearer"}),
        ]
        for answer in answers:
            assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", answer.text
            assert answer.json()["error"]["type"] == "invalid_request_error"
        assert info(srv.url, KEY)["limits"]["api_key_set"] is True and KEY not in str(info(srv.url, KEY))
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        assert httpx.get(srv.url + "/metrics").status_code == 200
        assert (
            httpx.get(srv.url + "/docs").status_code == 404 and httpx.get(srv.url + "/openapi.json").status_code == 404
        )
        texts = [a.text for a in answers] + [httpx.get(srv.url + "/metrics").text]
        for logger in loggers:
            logger.removeHandler(logs)
    assert all(KEY not in text for text in texts)
    logged = "\n".join(logs.lines)
    assert "401" in logged and KEY not in logged and KEY[:-1] not in logged  # access log lines, without the keys
    assert KEY not in repr(settings)


def test_protected_metrics_and_docs_flag(backend):
    settings = ServerSettings(api_key=KEY, protect_metrics=True, docs=True)
    with BackgroundServer(create_app(backend, settings)) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 401
        authorised = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert authorised.status_code == 200 and "dicache_http_requests_total" in authorised.text
        schema = httpx.get(srv.url + "/openapi.json").json()
        body = schema["paths"][GENERATIONS]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"prompt", "output_format", "cache_dit_params"} <= set(body["properties"])
        assert httpx.get(srv.url + "/docs").status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200 and httpx.get(srv.url + "/health_generate").is_success
    with pytest.raises(ValueError, match="protect_metrics needs an api_key"):
        ServerSettings(protect_metrics=True)


def test_exposure_warning_for_a_network_address_without_a_key():
    assert exposure_warnings("127.0.0.1", ServerSettings()) == []
    assert exposure_warnings("::1", ServerSettings()) == [] and exposure_warnings("localhost", ServerSettings()) == []
    assert exposure_warnings("0.0.0.0", ServerSettings(api_key=KEY)) == []
    (warning,) = exposure_warnings("0.0.0.0", ServerSettings())
    assert "--host 0.0.0.0" in warning and "DICACHE_API_KEY" in warning
    assert exposure_warnings("10.1.2.3", ServerSettings()) and exposure_warnings("my-host.local", ServerSettings())


# ---------------------------------------------------------------------------------------------- connection limits
def test_health_answers_while_many_bodies_are_half_sent(backend):
    """Issue 18 defect 2: 200 clients that send half a body hold nothing for long: /health answers meanwhile, each
    gets 408 after the body timeout, and the process's open descriptors come back down."""
    app = create_app(backend, ServerSettings(body_timeout_s=3.0))
    head = post_request(GENERATIONS, b'{"prompt": "a fox", "size": "16x16"}')
    with BackgroundServer(app, limits=ConnectionLimits(max_connections=400)) as srv:
        fds = lambda: metrics_text_to_dict(httpx.get(srv.url + "/metrics").text)[("process_open_fds", ())]  # noqa: E731
        baseline = fds()
        sockets = []
        try:
            for _ in range(200):
                sock = socket.create_connection((srv.host, srv.port), timeout=30)
                sock.sendall(head[:-10])  # headers and most of the body; the last 10 bytes never come
                sockets.append(sock)
            wait_until(lambda: fds() >= baseline + 200, what="the server to hold 200 connections")
            health = httpx.get(srv.url + "/health", timeout=5)
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            for sock in sockets:
                answer = sock.recv(65536)
                assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
                assert b"not received within 3 s" in answer and b"connection: close" in answer.lower()
        finally:
            for sock in sockets:
                sock.close()
        wait_until(lambda: fds() <= baseline + 5, what="the descriptors to be released")
        assert httpx.post(srv.url + GENERATIONS, json=TINY, timeout=60).status_code == 200


def test_connections_beyond_the_limit_get_503_and_slow_headers_are_closed(backend):
    app = create_app(backend, ServerSettings(body_timeout_s=30.0))
    limits = ConnectionLimits(max_connections=20, header_timeout_s=1.0)
    with BackgroundServer(app, limits=limits) as srv:
        held = []
        try:
            for _ in range(20):
                sock = socket.create_connection((srv.host, srv.port), timeout=30)
                sock.sendall(post_request(GENERATIONS, dumps(TINY))[:-5])
                held.append(sock)
            health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            # over the limit: answered 503 at once (not queued behind the stalled bodies) and closed
            wait_until(lambda: raw_http(srv.host, srv.port, health, timeout=10)[0] == 503, what="503 over the limit")
        finally:
            for sock in held:
                sock.close()
        wait_until(lambda: httpx.get(srv.url + "/health", timeout=5).status_code == 200, what="room again")
        slow = socket.create_connection((srv.host, srv.port), timeout=30)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        assert slow.recv(1024) == b""  # closed by the server after the header timeout (recv would block else)
        slow.close()


# ---------------------------------------------------------------------------------------------- drain
def test_drain_refuses_new_work_with_503_and_finishes_accepted_generations(backend):
    gated = GatedBackend(backend)
    app = create_app(gated, ServerSettings(max_queue=4, workers=1, drain_grace_s=60))
    srv = BackgroundServer(app).start()
    body = dumps(dict(prompt="a sun", size="16x16", num_inference_steps=2, seed=3))
    with ThreadPoolExecutor(2) as pool, gated:
        running = pool.submit(raw_http, srv.host, srv.port, post_request(GENERATIONS, body))
        assert gated.started.acquire(timeout=20)
        queued = pool.submit(raw_http, srv.host, srv.port, post_request(GENERATIONS, body))
        wait_until(lambda: info(srv.url)["queue"]["waiting"] == 1, what="a queued request")
        srv.request_stop()  # what SIGTERM does
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503, what="the drain to begin")
        assert httpx.get(srv.url + "/health").json() == {"status": "draining"}
        late = httpx.post(srv.url + GENERATIONS, content=body, headers={"content-type": "application/json"})
        assert late.status_code == 503 and late.headers["retry-after"] == "5"
        assert late.json()["error"]["code"] == "shutting_down" and "shutting down" in late.json()["error"]["message"]
        assert httpx.get(srv.url + "/v1/models").status_code == 503
        assert httpx.get(srv.url + "/health_generate").status_code == 503
        assert httpx.get(srv.url + "/metrics").status_code == 200
        gated.gate.set()
        for future in (running, queued):
            status, payload = future.result(60)
            assert status == 200 and b'"b64_json"' in payload
    srv.thread.join(30)
    assert not srv.thread.is_alive() and app.state.drain.unfinished == 0 and app.state.queue.running == 0


@pytest.mark.parametrize("how", ["grace-over", "second-signal"])
def test_drain_answers_what_cannot_finish_with_503(backend, how):
    """Past the grace period (or on a second SIGTERM) the running generation stops at its next block and the
    waiting one is dropped; both are answered 503, and the server stops."""
    grace = 0.5 if how == "grace-over" else 600
    app = create_app(backend, ServerSettings(workers=1, max_side=64, drain_grace_s=grace))
    srv = BackgroundServer(app).start()
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, srv.url + GENERATIONS, json=LONG, timeout=60)
        wait_until(lambda: info(srv.url)["queue"]["running"] == 1, what="a running generation")
        queued = pool.submit(httpx.post, srv.url + GENERATIONS, json=dict(LONG, seed=1), timeout=60)
        wait_until(lambda: info(srv.url)["queue"]["waiting"] == 1, what="a waiting generation")
        srv.request_stop()
        if how == "second-signal":
            wait_until(lambda: app.state.drain.draining, what="the drain")
            srv.hurry()
        for future in (running, queued):
            answer = future.result(60)
            assert answer.status_code == 503 and answer.headers["retry-after"] == "5", answer.text
            assert answer.json()["error"]["code"] == "shutting_down"
        assert "shut down before this request finished" in running.result().json()["error"]["message"]
    srv.thread.join(30)
    assert not srv.thread.is_alive() and app.state.drain.unfinished == 2


def start_cli(model_source, *options: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_CACHE_DIT_", "DICACHE_API_KEY"))}
    environ.update(SGLANG_CACHE_DIT_ENABLED="1", SGLANG_CACHE_DIT_WARMUP="1", OMP_NUM_THREADS="1", **(env or {}))
    command = [sys.executable, "-m", "dicache.cli", "serve", "--port", str(port), "--device", "cpu", *options]
    command += ["--model", model_source] if model_source else []
    proc = subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        assert proc.poll() is None, proc.stdout.read()
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, timeout=90, what="dicache serve to start")
    return proc, url


def test_cli_sigterm_drains_answers_late_and_stalled_clients_and_exits_0(model_source):
    """The real command with DICACHE_API_KEY: the openai client with the key; SIGTERM while one generation runs,
    one waits and one client trickles a body: late clients get 503 (the listener stays open), the stalled body is
    answered 503, the accepted generations finish, and the process exits 0 (so `backend.close()` runs)."""
    proc, url = start_cli(
        model_source, "--max-side", "64", "--drain-timeout", "60", "--workers", "1", env={"DICACHE_API_KEY": KEY}
    )  # one worker: one generation runs while the other waits
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        quick = client.images.generate(prompt="a heart", size="16x16", extra_body={"num_inference_steps": 3})
        assert quick.model_extra["cache_stats"]["branches"]["cond"]["reasons"]["0"] == "warmup"  # env settings
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        slow = dict(prompt="a house", size="32x32", num_inference_steps=24, guidance_scale=4.5, seed=1)
        with ThreadPoolExecutor(2) as pool:
            in_flight = pool.submit(httpx.post, url + GENERATIONS, json=slow, headers=auth, timeout=120)
            wait_until(lambda: info(url, KEY)["queue"]["running"] == 1, what="a running request")
            waiting = pool.submit(httpx.post, url + GENERATIONS, json=dict(slow, seed=2), headers=auth, timeout=120)
            wait_until(lambda: info(url, KEY)["queue"]["waiting"] == 1, what="a waiting request")
            stalled = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
            stalled.sendall(post_request(GENERATIONS, dumps(TINY), key=KEY)[:-8])  # the body's end never comes
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(url + "/health").status_code == 503, what="the drain")
            late = httpx.post(url + GENERATIONS, json=TINY, headers=auth)
            assert late.status_code == 503 and late.headers["retry-after"] == "5"
            assert stalled.recv(65536).startswith(b"HTTP/1.1 503")
            stalled.close()
            for future in (in_flight, waiting):
                response = future.result(120)
                assert response.status_code == 200 and response.json()["cache_stats"]["num_steps"] == 24
        assert proc.wait(30) == 0
        output = proc.stdout.read()
        assert "every accepted request was answered" in output and KEY not in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_second_sigterm_stops_unfinished_generations_and_exits_0(model_source):
    proc, url = start_cli(model_source, "--max-side", "64", "--drain-timeout", "600")
    try:
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(httpx.post, url + GENERATIONS, json=LONG, timeout=120)
            wait_until(lambda: info(url)["queue"]["running"] == 1, what="a running request")
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(url + "/health").status_code == 503, what="the drain")
            time.sleep(0.5)
            assert proc.poll() is None  # the first signal waits for the generation (600 s grace)
            proc.send_signal(signal.SIGTERM)
            answer = in_flight.result(60)
        assert answer.status_code == 503 and "shut down before this request finished" in answer.text
        assert proc.wait(30) == 0
        assert "1 unfinished generation(s) answered 503" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------- option validation
@pytest.mark.parametrize(
    "options, expected",
    [
        (["--port", "99999"], "argument --port: '99999' is invalid: must be an integer between 1 and 65535"),
        (["--port", "http"], "argument --port: 'http' is invalid"),
        (
            ["--timeout", "nan"],
            "argument --timeout: 'nan' is invalid: must be a finite number of seconds > 0 and <= 86400",
        ),
        (["--timeout", "0"], "argument --timeout: '0' is invalid"),
        (["--max-queue", "-1"], "argument --max-queue: '-1' is invalid: must be an integer between 0 and 100000"),
        (["--workers", "0"], "argument --workers: '0' is invalid: must be an integer between 1 and 64"),
        (["--max-side", "8"], "argument --max-side: '8' is invalid: must be an integer between 16 and 8192"),
        # upper bounds: a huge limit is a typo, not a setting (it would also bypass what the limit protects)
        (
            ["--max-side", "4" + "0" * 24],
            "argument --max-side: '4" + "0" * 24 + "' is invalid: must be an integer betw",
        ),
        (["--max-n", "1000"], "argument --max-n: '1000' is invalid: must be an integer between 1 and 64"),
        (["--max-steps", "100000"], "argument --max-steps: '100000' is invalid: must be an integer between 1 and 1000"),
        (
            ["--timeout", "1e300"],
            "argument --timeout: '1e300' is invalid: must be a finite number of seconds > 0 and <= 86400",
        ),
        (
            ["--max-connections", "10000000"],
            "argument --max-connections: '10000000' is invalid: must be an integer betw",
        ),
        (["--max-body-bytes", "10"], "argument --max-body-bytes: '10' is invalid: must be an integer between 1024 and"),
        (["--drain-timeout", "inf"], "argument --drain-timeout: 'inf' is invalid"),
        (["--body-timeout", "-1"], "argument --body-timeout: '-1' is invalid"),
        (["--max-connections", "0"], "argument --max-connections: '0' is invalid"),
        (["--default-size", "100x100"], "argument --default-size: '100x100' is invalid: each side must be a multiple"),
    ],
)
def test_cli_refuses_nonsense_limits(options, expected, capsys):
    """Issue 18 defect 5: every limit is checked like a request field (no traceback, no 429-everything queue)."""
    with pytest.raises(SystemExit) as caught:
        cli_main(["serve", *options])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_cli_refuses_metrics_auth_without_a_key_and_too_many_connections(monkeypatch, capsys):
    monkeypatch.delenv("DICACHE_API_KEY", raising=False)
    assert cli_main(["serve", "--metrics-auth", "--model", "/nonexistent"]) == 2
    assert "--metrics-auth needs an API key (--api-key or DICACHE_API_KEY)" in capsys.readouterr().err
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY:
        assert cli_main(["serve", "--max-connections", str(hard + 1), "--model", "/nonexistent"]) == 2
        assert f"--max-connections={hard + 1} is invalid" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- background tasks
def test_background_tasks_run_for_the_app_lifetime(backend):
    """`create_app(background=...)`: each coroutine function runs once the queue does, with the app, and is
    cancelled at shutdown (a Ray replica follows its driver's drain this way)."""
    import asyncio

    seen: list[str] = []

    async def follower(app) -> None:
        seen.append(f"started, queue running: {app.state.queue.num_workers > 0}, draining: {app.state.drain.draining}")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    with BackgroundServer(create_app(backend, ServerSettings(drain_grace_s=0), background=[follower])) as srv:
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        assert seen == ["started, queue running: True, draining: False"]
    assert seen[1:] == ["cancelled"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process start time is read from /proc")
def test_the_process_start_is_timed_to_a_clock_tick_not_to_the_boot_times_second():
    """The start-up phases count from the process's start (`process_start_time`): a child process's is after the
    moment it was launched (less a clock tick) and before its first line ran. Adding its clock ticks to the whole
    second of `/proc/stat`'s boot time put it up to a second before the launch."""
    child = (
        "import time; first = time.time()\n"
        "import json; from dicache.server.startup import process_start_time\n"
        "print(json.dumps([process_start_time(), first]))"
    )
    launched = time.time()
    start, first = json.loads(subprocess.run([sys.executable, "-c", child], capture_output=True, check=True).stdout)
    assert launched - 0.02 <= start <= first + 0.01


def test_cli_reports_its_start_up_phases_imports_and_what_it_read_while_importing(tmp_path):
    """`/v1/server_info` "startup" of the real command on a local checkpoint folder: the phases from the process's
    start (imports split into the interpreter's start and the command's modules), the weights read, and the prefetch
    that read the folder's weight files while the process imported (`--prefetch-weights`, on by default)."""
    model = tmp_path / "krea2"
    shutil.copytree(EMBEDDED, model)
    proc, url = start_cli(str(model), "--max-side", "64")
    try:
        startup = info(url)["startup"]
        assert {"imports", "weights"} <= startup["phases_s"].keys()
        split = startup["imports"]
        assert split["interpreter_s"] >= 0 and split["modules_s"] > 0
        # the phase also counts the imports loading needs later (transformers' text-encoder code)
        assert 0 < split["interpreter_s"] + split["modules_s"] <= startup["phases_s"]["imports"] + 0.01
        # the main thread's CPU seconds: some, and no more than the wall time they were spent in
        assert 0 < split["cpu_s"] <= split["interpreter_s"] + split["modules_s"] + 0.05
        assert isinstance(split["major_page_faults"], int) and split["major_page_faults"] >= 0
        weights = sorted(model.glob("*/*.safetensors"))
        prefetched = startup["prefetch"]
        assert prefetched["files"] == len(weights) and prefetched["unreadable"] == 0
        assert prefetched["done"] and prefetched["GB"] == round(sum(f.stat().st_size for f in weights) / 1e9, 3)
        assert "text_lengths" not in startup  # on the CPU the prompt lengths are not prepared
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
