"""`BodyLimitMiddleware`: read a request body whole, bounded in size and time, before anything parses it.

- A declared `Content-Length` over `max_bytes` is answered 413 at once; a chunked body is read up to the limit.
- The whole body must arrive within `timeout_s` seconds of the request's headers, else 408: a client trickling its
  body (or sending none) cannot hold a connection, a file descriptor and a task for long.
- A drain that begins while the body is still arriving answers 503 (the request was not accepted yet).

These answers close the connection (the rest of the body is never read). The app then receives the body in one
message, so it never sees more than `max_bytes`.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .drain import SHUTDOWN_MESSAGE, Drain
from .errors import send_error


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, drain: Drain | None = None) -> None:
        self.app, self.max_bytes, self.timeout_s, self.drain = app, max_bytes, timeout_s, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                shown = declared.decode(errors="replace")[:40]
                await send_error(send, 400, f"invalid Content-Length header {shown!r}", close=True)
                return
            if size > self.max_bytes:
                await send_error(send, 413, self._too_large(f"{size} bytes"), close=True)
                return
        body = await self._read(receive, send)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the server's receive does

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering (413 / 408 / 503) or when the client left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        drained = asyncio.ensure_future(self.drain.began_event().wait()) if self.drain is not None else None
        chunks: list[bytes] = []
        received = 0
        try:
            while True:
                message = asyncio.ensure_future(receive())
                waiting = {message} if drained is None else {message, drained}
                done, _ = await asyncio.wait(
                    waiting, timeout=max(0.0, deadline - loop.time()), return_when=asyncio.FIRST_COMPLETED
                )
                if message not in done:
                    message.cancel()
                    if drained is not None and drained in done:
                        await send_error(send, 503, SHUTDOWN_MESSAGE, "shutting_down", close=True)
                    else:
                        await send_error(send, 408, self._too_slow(received), "body_timeout", close=True)
                    return None
                event = message.result()
                if event["type"] == "http.disconnect":
                    return None
                chunk = event.get("body", b"")
                received += len(chunk)
                if received > self.max_bytes:
                    await send_error(send, 413, self._too_large(f"more than {self.max_bytes} bytes"), close=True)
                    return None
                chunks.append(chunk)
                if not event.get("more_body", False):
                    return b"".join(chunks)
        finally:
            if drained is not None:
                drained.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drained

    def _too_large(self, got: str) -> str:
        return f"request body too large: {got}; the limit is {self.max_bytes} bytes (server option --max-body-bytes)"

    def _too_slow(self, received: int) -> str:
        return (
            f"request body not received within {self.timeout_s:g} s ({received} bytes arrived); "
            "server option --body-timeout"
        )
