"""`ServerSettings`: the HTTP app's own limits and exposure (queue, workers, timeouts, input bounds, API key, drain).

Cache settings are not here: they come from `SGLANG_CACHE_DIT_*` over an optional settings profile
(`dicache.profiles.cache_config`: `--profile` or `SGLANG_CACHE_DIT_PROFILE`) at start-up and from each request's
`cache_dit_params`. Everything here is enforced inside the ASGI app, so any ASGI host (uvicorn, Ray Serve) gets it;
connection-level limits (`ConnectionLimits`: concurrent connections, keep-alive, request heads) belong to the host
(`dicache.server.runner` applies them to uvicorn).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerSettings:
    """Bounds every request is checked against; a value outside them is a 400 naming the field.

    Attributes:
        model_id: the name `GET /v1/models` lists; a request's `model`, when given, must equal it.
        max_queue: requests allowed to wait for a busy worker; one more is answered 429 (running ones do not count;
            0: no waiting, a request is taken only when a worker is free).
        workers: generations run at once. 1 (default) runs one at a time; each request's output does not depend
            on this number, because requests never share cache state or random generators.
        request_timeout_s: seconds from arrival to answer (waiting + generating); past it the answer is 504 and the
            generation stops at its next block.
        max_n: most images per request.
        min_side, max_side, size_multiple: bounds of `size` "WxH" (each side a multiple of `size_multiple`).
        max_pixels: most pixels per image (width * height).
        max_steps: most denoising steps per request.
        max_prompt_chars: longest `prompt` / `negative_prompt`, in characters.
        max_body_bytes: largest request body; a larger one is answered 413 before it is parsed.
        body_timeout_s: seconds a request body may take to arrive (after its headers); then 408.
        api_key: when set, `/v1/*` needs `Authorization: Bearer <api_key>` (401 otherwise). Never shown in repr.
        protect_metrics: `/metrics` needs the key too (only with `api_key`).
        docs: serve `/docs` and `/openapi.json` (off by default: they list the whole API surface).
        drain_grace_s: on shutdown, seconds accepted generations may take to finish; the rest is answered 503.
    """

    model_id: str = "krea-2"
    max_queue: int = 16
    workers: int = 1
    request_timeout_s: float = 600.0
    max_n: int = 4
    min_side: int = 16
    max_side: int = 2048
    size_multiple: int = 16
    max_pixels: int = 2048 * 2048
    max_steps: int = 200
    max_prompt_chars: int = 4000
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0
    api_key: str | None = field(default=None, repr=False)
    protect_metrics: bool = False
    docs: bool = False
    drain_grace_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_queue", "workers", "max_n", "min_side", "size_multiple", "max_steps", "max_prompt_chars"):
            value, low = getattr(self, name), 0 if name == "max_queue" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ServerSettings.{name}={value!r} is invalid: must be an integer >= {low}")
        for name, low in (("request_timeout_s", 0.0), ("body_timeout_s", 0.0)):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > low):
                raise ValueError(f"ServerSettings.{name}={value!r} is invalid: must be a finite number > 0")
        if not (isinstance(self.drain_grace_s, int | float) and math.isfinite(self.drain_grace_s)) or (
            self.drain_grace_s < 0
        ):
            raise ValueError(f"ServerSettings.drain_grace_s={self.drain_grace_s!r} is invalid: must be finite, >= 0")
        if self.max_side < self.min_side:
            raise ValueError(f"ServerSettings.max_side={self.max_side} must be >= min_side={self.min_side}")
        if self.max_pixels < self.min_side * self.min_side:
            raise ValueError(f"ServerSettings.max_pixels={self.max_pixels} must be >= min_side squared")
        if self.max_body_bytes < 1024:
            raise ValueError(f"ServerSettings.max_body_bytes={self.max_body_bytes} is invalid: must be >= 1024")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("ServerSettings.api_key is empty: give a key or None (no authentication)")
        if self.protect_metrics and self.api_key is None:
            raise ValueError("ServerSettings.protect_metrics needs an api_key")

    def public(self) -> dict[str, object]:
        """The limits, for `/v1/server_info` (no key)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "api_key"}
        return {**values, "api_key_set": self.api_key is not None}


@dataclass(frozen=True)
class ConnectionLimits:
    """Connection-level limits of the uvicorn host.

    Attributes:
        max_connections: open connections (and requests in progress) before new requests get 503.
        keep_alive_s: an idle keep-alive connection is closed after this many seconds.
        header_timeout_s: a connection that has not sent a complete request head within this many seconds of
            opening is closed (slow-header clients).
        shutdown_timeout_s: after the drain, seconds uvicorn waits for connections to finish before cancelling.
    """

    max_connections: int = 1000
    keep_alive_s: float = 5.0
    header_timeout_s: float = 10.0
    shutdown_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_connections, bool)
            or not isinstance(self.max_connections, int)
            or (self.max_connections < 1)
        ):
            raise ValueError(f"max_connections={self.max_connections!r} is invalid: must be an integer >= 1")
        for name in ("keep_alive_s", "header_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} is invalid: must be a finite number > 0")
