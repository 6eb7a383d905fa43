"""Ray Serve's own HTTP failures in the OpenAI error shape: a middleware for Serve's HTTP proxy.

Under Ray Serve every request passes Serve's proxy before it reaches a replica's app (`create_app`), and the proxy
answers some requests itself, in plain text: an empty 500 when the replica serving a request died, 503 when its
router queue is full or no replica is up, 408 when its `request_timeout_s` ran out. `ServeErrorsMiddleware`
rewrites those answers, and only those (an answer with a JSON body came from the app and passes unchanged), into
the app's error contract:

| Serve's answer | becomes | `code` |
| --- | --- | --- |
| no answer or a plain 500: the replica died or failed before answering | 503 + Retry-After | `replica_unavailable` |
| 503 "Request dropped due to backpressure" | 429 + Retry-After | `queue_full` |
| any other plain 503 (no replica running, node draining) | 503 + Retry-After | `unavailable` |
| 408 (proxy timeout) | 504 | `timeout` |
| any other plain 4xx / 5xx | same status | None |

Serve's own endpoints (`/-/healthz`, `/-/routes`) are left alone. Install it on every node's proxy by setting, in the
environment of the processes that start Ray (`ray start`, or the driver of a local cluster),

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=dicache.server.ray.proxy:proxy_middlewares

(`dicache serve --ray` sets it for the local cluster it starts; the KubeRay manifest sets it in the pods). This
module imports neither Ray nor torch.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "dicache.server.ray.proxy:proxy_middlewares"
RETRY_AFTER_S = 1
MAX_HELD_BODY = 16 * 1024
"""Bytes of a plain-text error body kept for the rewritten message (Serve's are one line)."""

_TYPES = {404: "not_found_error", 429: "rate_limit_error", 503: "server_unavailable", 504: "timeout_error"}


def translate(status: int, text: str) -> tuple[int, str, str | None, bool]:
    """(status, message, code, retry) for a plain-text answer `status`/`text` produced by Ray Serve's proxy."""
    text = " ".join(text.split())[:500]
    if status == 500:
        detail = f" ({text})" if text and text != "Internal Server Error" else ""
        message = (
            "the replica serving this request stopped or failed before answering (Ray Serve)"
            f"{detail}; nothing was generated for it: retry, another replica will take it"
        )
        return 503, message, "replica_unavailable", True
    if status == 503 and "backpressure" in text.lower():
        return 429, f"every replica's queue is full ({text}); retry later", "queue_full", True
    if status == 503:
        return (
            503,
            f"no replica can take the request now ({text or 'Ray Serve unavailable'}); retry",
            "unavailable",
            True,
        )
    if status == 408:
        return 504, f"request timed out in Ray Serve ({text})", "timeout", False
    return status, text or f"HTTP {status} from Ray Serve", None, False


def error_messages(status: int, message: str, code: str | None, retry: bool) -> list[Message]:
    """The ASGI messages of an OpenAI-shaped JSON error answer."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    return [
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": body, "more_body": False},
    ]


def _is_json(headers: Any) -> bool:
    for key, value in headers or ():
        if bytes(key).lower() == b"content-type":
            return bytes(value).split(b";")[0].strip().lower().endswith(b"json")
    return False


class ServeErrorsMiddleware:
    """Pure ASGI middleware for Serve's proxy app (see the module docstring for what it rewrites)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith("/-/"):
            await self.app(scope, receive, send)
            return
        started = False  # an answer went (or is going) to the client unchanged
        held: dict[str, Any] | None = None  # a plain-text error being collected for rewriting
        body = b""

        async def forward(message: Message) -> None:
            nonlocal started, held, body
            kind = message["type"]
            if kind == "http.response.start" and not started and held is None:
                if message["status"] >= 400 and not _is_json(message.get("headers")):
                    held = message
                    return
                started = True
            elif kind == "http.response.body" and held is not None:
                body = (body + message.get("body", b""))[:MAX_HELD_BODY]
                if not message.get("more_body", False):
                    status, text = held["status"], body.decode("utf-8", "replace")
                    held, started = None, True
                    for out in error_messages(*translate(status, text)):
                        await send(out)
                return
            await send(message)

        try:
            await self.app(scope, receive, forward)
        except Exception as exc:
            if started:
                raise
            for out in error_messages(*translate(500, f"{type(exc).__name__}: {exc}")):
                await send(out)
            return
        if not started:  # the proxy gave up without answering (the replica died mid-request)
            status = held["status"] if held is not None else 500
            for out in error_messages(*translate(status, body.decode("utf-8", "replace"))):
                await send(out)


def proxy_middlewares() -> list:
    """The callback Ray Serve's proxy calls (via `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`) for its middlewares."""
    return [Middleware(ServeErrorsMiddleware)]
