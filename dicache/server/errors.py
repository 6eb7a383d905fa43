"""HTTP errors in OpenAI's shape, and the handlers that turn every failure into one (never an unhandled 500).

Bad input is a 400 whose message names the field, the value given and what is allowed.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Send

from ..formatting import clip_repr
from .schemas import ErrorDetail, ErrorResponse, ImageGenerationRequest

log = logging.getLogger("dicache.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    408: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "server_unavailable",
    504: "timeout_error",
}


MAX_PROBLEMS = 5
"""Problems one 400 lists (a body can hold thousands); the rest are counted."""
MAX_NAME = 100
"""Characters of a field name quoted in a 400."""

RETRY_AFTER_S = 5
"""`Retry-After` of 429 and 503 answers, in seconds."""


class ApiError(Exception):
    """An answer other than 200: status, a message for the client, and the request field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for `status`."""
    detail = ErrorDetail(message=message, type=_TYPES.get(status, "error"), param=param, code=code)
    return ErrorResponse(error=detail).model_dump()


def error_headers(status: int) -> dict[str, str]:
    """`Retry-After` on 429 / 503 (come back later), `WWW-Authenticate` on 401."""
    if status in (429, 503):
        return {"Retry-After": str(RETRY_AFTER_S)}
    if status == 401:
        return {"WWW-Authenticate": "Bearer"}
    return {}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=error_headers(status))


async def send_error(send: Send, status: int, message: str, code: str | None = None, close: bool = False) -> None:
    """Answer from ASGI middleware (before the app): OpenAI's error shape, its headers, optionally closing the
    connection (when the request body was not read to its end)."""
    payload = json.dumps(error_body(status, message, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error_headers(status).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def describe_validation_error(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """One readable message for pydantic's errors (field, value, what is allowed) and the first field's name.

    `errors`: `ValidationError.errors()` of `ImageGenerationRequest.model_validate_json(body)` (or FastAPI's
    `RequestValidationError.errors()`, whose locations start with "body")."""
    messages: list[str] = []
    first_param: str | None = None
    for err in errors:
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        kind = err.get("type", "")
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "invalid JSON")
            return f"malformed JSON body: {detail}", None
        if kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
            if isinstance(err.get("input"), bytes):
                return "request body is not JSON: send a JSON object with 'Content-Type: application/json'", None
            return f"request body must be a JSON object, got {clip_repr(err.get('input'), 80)}", None
        if kind == "missing" and not loc:
            return "request body is missing: send a JSON object with at least 'prompt'", None
        field = ".".join(loc)[:MAX_NAME] or "body"  # a name can be as long as the body
        first_param = first_param or field
        if kind == "extra_forbidden":
            allowed = ", ".join(ImageGenerationRequest.model_fields)
            got = clip_repr(err.get("input"), 80)
            messages.append(f"unknown field {field!r} (got {got}); accepted fields: {allowed}")
        elif kind == "missing":
            messages.append(f"{field} is required")
        else:
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            messages.append(f"{field}={clip_repr(err.get('input'), 80)} is invalid: {msg}")
    if len(messages) > MAX_PROBLEMS:
        messages = [*messages[:MAX_PROBLEMS], f"and {len(messages) - MAX_PROBLEMS} more problem(s)"]
    return "; ".join(messages) or "invalid request", first_param


_POSITION = re.compile(r" at line (\d+) column (\d+)$")
_KEY = re.compile(rb'"((?:[^"\\]|\\.){1,100})"\s*:')


def key_at_error(raw: bytes, message: str) -> str | None:
    """The JSON key whose value is at the position a "malformed JSON body: ... at line L column C" message names
    (the last key before it), so that e.g. a 5000-digit number names its field; None if there is none."""
    found = _POSITION.search(message)
    if found is None:
        return None
    line, column = int(found.group(1)), int(found.group(2))
    lines = raw.split(b"\n")
    if line > len(lines):
        return None
    before = b"\n".join(lines[: line - 1] + [lines[line - 1][:column]])
    keys = _KEY.findall(before)
    return keys[-1].decode(errors="replace") if keys else None


def allowed_methods(request: Request) -> str:
    """The `Allow` value of a 405: every method that some route at the request's path answers (a path served by
    several routes, e.g. GET and HEAD `/health`, lists them all)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    """Map ApiError, request validation, HTTP errors and anything unexpected to OpenAI-shaped JSON."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            message = "malformed JSON body: it could not be decoded (send a UTF-8 JSON object)"
        elif exc.status_code == 405:
            allow = allowed_methods(request)
            message = f"method {request.method} is not allowed on {request.url.path}; allowed: {allow}"
            response = error_response(405, message)
            response.headers["Allow"] = allow  # RFC 9110 15.5.6
            return response
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
