"""`BodySizeLimitMiddleware`: answer 413 to a request body larger than the limit, before anything parses it.

A declared `Content-Length` over the limit is refused at once; otherwise (chunked bodies) the body is read up to the
limit and replayed to the app, so the app never sees more than `max_bytes`.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await self._reject(send, 400, f"invalid Content-Length header {declared.decode(errors='replace')!r}")
                return
            if size > self.max_bytes:
                await self._reject(send, 413, self._too_large(f"{size} bytes"))
                return
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                await self._reject(send, 413, self._too_large(f"more than {self.max_bytes} bytes"))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the server's receive does

        await self.app(scope, replay, send)

    def _too_large(self, got: str) -> str:
        return f"request body too large: {got}; the limit is {self.max_bytes} bytes (server option --max-body-bytes)"

    @staticmethod
    async def _reject(send: Send, status: int, message: str) -> None:
        kind = "invalid_request_error"
        payload = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
