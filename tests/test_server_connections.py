"""Connection abuse (issue 45, part 4): idle connections never crowd out requests. At `--max-connections` a new
connection closes the longest-open idle one (`runner.IdleShedding`); 1,000 idle connections held open on loopback
(the default limit) leave normal requests served and the server's memory bounded.

The test process is client and server at once: it needs about two descriptors per connection, so the soft
`RLIMIT_NOFILE` is raised for it (skipped when even the hard limit is too low)."""

from __future__ import annotations

import os
import pathlib
import socket
import time

import httpx
import pytest
from server_helpers import backend_with_env, metrics_text_to_dict, pipeline_source, post_request, wait_until

from dicache.errors import ConfigError
from dicache.server import ServerSettings, create_app
from dicache.server.background import BackgroundServer
from dicache.server.runner import ConnectionLimits, ensure_descriptors

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

GENERATIONS = "/v1/images/generations"
TINY = dict(prompt="a red fox", size="16x16", num_inference_steps=2, seed=1)
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
LONG_S = 300.0  # header and keep-alive timeouts long enough that no idle connection closes by itself in a test


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return backend_with_env(pipeline_source(tmp_path_factory.mktemp("krea2")), {})


def descriptors_for(connections: int) -> None:
    try:
        ensure_descriptors(2 * connections + 256)
    except ConfigError as exc:
        pytest.skip(f"the descriptor limit is too low for {connections} connections in one process: {exc}")


def open_idle(host: str, port: int, silent: int, kept_alive: int) -> tuple[list[socket.socket], list[socket.socket]]:
    """`silent` connections that never send a byte, and `kept_alive` ones that made one request (GET /health) and
    stay open, idle, waiting for their next."""
    silent_sockets = [socket.create_connection((host, port), timeout=30) for _ in range(silent)]
    kept = []
    for _ in range(kept_alive):
        sock = socket.create_connection((host, port), timeout=30)
        sock.sendall(HEALTH)
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
        kept.append(sock)
    return silent_sockets, kept


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed `sock`: a read that does not wait finds the end of the stream."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.settimeout(timeout)


def rss_bytes() -> int:
    return int(pathlib.Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_idle_connections_at_the_limit_make_room_for_new_requests(backend):
    """20 silent and 10 kept-alive connections reach a 30-connection server's limit: the 30th and each later new
    connection close a silent one (never a kept-alive one while silent ones are left) instead of a request getting
    503."""
    limits = ConnectionLimits(max_connections=30, header_timeout_s=LONG_S, keep_alive_s=LONG_S)
    with BackgroundServer(create_app(backend, ServerSettings()), limits=limits) as srv:
        connections = srv.server.server_state.connections
        silent, kept = open_idle(srv.host, srv.port, silent=20, kept_alive=10)
        try:
            wait_until(lambda: len(connections) == 29, what="the server to hold 29 connections")
            for _ in range(5):
                assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
            assert httpx.post(srv.url + GENERATIONS, json=TINY, timeout=120).status_code == 200
            time.sleep(0.2)
            shed = sum(closed_by_server(sock) for sock in silent)
            assert 2 <= shed <= 7, shed  # one per connection made at the limit: the 30th, the first request's, ...
            assert not any(closed_by_server(sock) for sock in kept)
            for sock in kept:  # still served on their connection
                sock.sendall(HEALTH)
                assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        finally:
            for sock in silent + kept:
                sock.close()


def test_requests_are_served_while_1000_idle_connections_are_held(backend):
    """The default `--max-connections` (1000) held by idle connections, half silent and half kept alive, on
    loopback: /health, /v1/models and generations are all answered 200 meanwhile; the process grows by less than
    32 KiB per idle connection, and once they close its descriptors come back."""
    defaults = ConnectionLimits()
    held = defaults.max_connections
    descriptors_for(held)
    limits = ConnectionLimits(header_timeout_s=LONG_S, keep_alive_s=LONG_S)
    with BackgroundServer(create_app(backend, ServerSettings()), limits=limits) as srv:
        connections = srv.server.server_state.connections
        assert httpx.post(srv.url + GENERATIONS, json=TINY, timeout=120).status_code == 200  # warm
        rss_before, fds_before = rss_bytes(), open_fds()
        silent, kept = open_idle(srv.host, srv.port, silent=held // 2, kept_alive=held - held // 2)
        try:
            wait_until(lambda: len(connections) >= held - 1, what=f"the server to hold {held} connections")
            rss_held = rss_bytes()
            statuses = []
            with httpx.Client(timeout=120) as client:  # one more connection, kept alive across its requests
                for i in range(5):
                    statuses.append(client.get(srv.url + "/health").status_code)
                    statuses.append(client.get(srv.url + "/v1/models").status_code)
                    statuses.append(client.post(srv.url + GENERATIONS, json={**TINY, "seed": i}).status_code)
            statuses += [httpx.get(srv.url + "/health", timeout=30).status_code for _ in range(5)]  # new connections
            assert statuses == [200] * 20
            still_open = sum(not closed_by_server(sock) for sock in silent + kept)
            assert still_open >= held - 10, still_open  # the idle connections were held throughout
            assert rss_held - rss_before < 32 * 1024 * held, (rss_before, rss_held)
        finally:
            for sock in silent + kept:
                sock.close()
        wait_until(lambda: len(connections) == 0, what="the server to close the idle connections")
        wait_until(lambda: open_fds() <= fds_before + 2, what="the descriptors to come back")
        assert httpx.post(srv.url + GENERATIONS, json=TINY, timeout=120).status_code == 200


def test_a_client_leaving_in_the_middle_of_its_body_is_counted_499_not_500(backend):
    """The app answers nothing to a client that left; `/metrics` counted that as a server error (500)."""
    body = b'{"prompt": "a red fox", "size": "16x16", "num_inference_steps": 2}'
    with BackgroundServer(create_app(backend, ServerSettings())) as srv:
        for cut in (len(body) // 2, len(body)):  # in the middle of its body; after it, during the generation
            with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
                sock.sendall(post_request(GENERATIONS, body)[: -len(body) + cut or None])

        def statuses() -> dict[str, float]:
            figures = metrics_text_to_dict(httpx.get(srv.url + "/metrics").text)
            return {
                dict(labels)["status"]: value
                for (name, labels), value in figures.items()
                if name == "dicache_http_requests_total" and dict(labels)["endpoint"] == GENERATIONS
            }

        wait_until(lambda: sum(statuses().values()) == 2, what="both requests to be counted")
        assert statuses() == {"499": 2.0}
