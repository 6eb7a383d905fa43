"""Helpers for the live-server tests: the pipeline to serve, a gate to hold a worker busy, raw HTTP, PNG decoding."""

from __future__ import annotations

import base64
import io
import json
import os
import pathlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

EMBEDDED = pathlib.Path(__file__).resolve().parents[1] / "dicache" / "assets" / "krea2-tiny"


def pipeline_source(tmp_dir: pathlib.Path) -> str | None:
    """None (the embedded checkpoint) when it ships, else a tiny random diffusers-layout Krea-2 built in `tmp_dir`."""
    if EMBEDDED.is_dir():
        return None
    from tiny_krea2 import build_tiny_pipeline

    build_tiny_pipeline(tmp_dir, distilled=True, seed=0)
    return str(tmp_dir)


def backend_with_env(model_source: str | None, env: dict[str, str], variant: str | None = None) -> Any:
    """The real backend on CPU, its cache settings read from exactly `env`'s SGLANG_CACHE_DIT_* at start-up (as
    `dicache serve` does), default size 32x32; `variant` as `dicache serve --variant`."""
    import pytest

    from dicache.server import load_backend

    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("SGLANG_CACHE_DIT_")]:
            mp.delenv(name)
        for name, value in env.items():
            mp.setenv(name, value)
        return load_backend(model_source, variant, device="cpu", default_size=(32, 32))


def metrics_text_to_dict(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted label pairs): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatedBackend:
    """Wraps a real backend: each generation first waits for `gate` (so a test can keep the worker busy) and
    announces itself in `started`. Everything else is the real backend."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.cache_config, self.defaults, self.num_blocks = backend.cache_config, backend.defaults, backend.num_blocks
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)

    def __enter__(self) -> GatedBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.gate.set()  # never leave a worker blocked, whatever the test did

    def generate(self, spec: Any, should_stop: Callable[[], bool] | None = None) -> Any:
        self.started.release()
        if not self.gate.wait(60):
            raise TimeoutError("test gate never opened")
        return self.backend.generate(spec, should_stop=should_stop)


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def raw_http(host: str, port: int, request: bytes, read: bool = True, timeout: float = 30.0) -> tuple[int, bytes]:
    """Send raw bytes over a fresh connection; return (status, body). With read=False, close right after sending."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(request)
        if not read:
            return 0, b""
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    break
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def post_request(
    path: str, body: bytes, content_type: str = "application/json", host: str = "127.0.0.1", key: str | None = None
) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n{auth}"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def decode_png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()
