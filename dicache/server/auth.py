"""`ApiKeyMiddleware`: `Authorization: Bearer <key>` on `/v1/*` (and on `/metrics` when asked), as OpenAI's API and
SGLang's `--api-key` do.

A missing or wrong key is answered 401 in OpenAI's error shape (the `openai` client raises `AuthenticationError`)
before the body is read. Keys are compared in constant time (`hmac.compare_digest`); neither the server's key nor the
one a client sent appears in any answer or log line. `/health` and `/health_generate` stay open (probes carry no key).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import send_error
from .settings import API_KEY_ENV

__all__ = ["API_KEY_ENV", "ApiKeyMiddleware", "bearer_token", "is_protected"]


def is_protected(path: str, protect_metrics: bool) -> bool:
    """Whether `path` needs the key: the OpenAI API (`/v1`, `/v1/...`), and `/metrics` with `protect_metrics`."""
    return path == "/v1" or path.startswith("/v1/") or (protect_metrics and path == "/metrics")


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), else None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        if not api_key:
            raise ValueError("ApiKeyMiddleware needs a non-empty api_key")
        self.app, self._key, self.protect_metrics = app, api_key.encode(), protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_protected(scope.get("path", ""), self.protect_metrics):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope.get("headers") or [])
        if token is None:
            message = "missing API key: send the header 'Authorization: Bearer <key>' (the server's --api-key)"
            await send_error(send, 401, message, "invalid_api_key", close=True)
            return
        if not hmac.compare_digest(token, self._key):
            await send_error(
                send, 401, "invalid API key given in the Authorization header", "invalid_api_key", close=True
            )
            return
        await self.app(scope, receive, send)
