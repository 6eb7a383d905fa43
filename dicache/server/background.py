"""`BackgroundServer`: run an ASGI app with uvicorn on a loopback port in a daemon thread (tests, benchmarks).

    with BackgroundServer(app) as server:
        httpx.get(server.url + "/health")

It is `dicache serve`'s `DrainingServer` with the same connection limits: `request_stop()` does what the first
SIGTERM does (drain, then exit), `hurry()` what the second does (stop unfinished generations now).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from .runner import ConnectionLimits, DrainingServer, uvicorn_config


class BackgroundServer:
    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        limits: ConnectionLimits | None = None,
    ) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"BackgroundServer is for loopback only, got host={host!r}")
        self.socket = socket.socket(socket.AF_INET6 if host == "::1" else socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        limits = limits or ConnectionLimits()
        self.server = DrainingServer(uvicorn_config(app, limits, log_level), limits)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def request_stop(self) -> None:
        """Begin a graceful shutdown (like SIGTERM: drain, then exit) without waiting."""
        self.server.request_drain()

    def hurry(self) -> None:
        """Like a second SIGTERM: stop the unfinished generations now."""
        self.server.hurry()

    def stop(self, timeout: float = 60.0) -> None:
        self.request_stop()
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError(f"the server on {self.url} did not stop within {timeout} s")
        self.socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
