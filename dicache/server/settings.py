"""`ServerSettings`: the HTTP app's own limits and exposure (queue, workers, timeouts, input bounds, API key, drain);
`ConnectionLimits` (the uvicorn host's), `ServerProcessOptions` (default size, threads, API key option) and
`ListenOptions` (address, log level): every `dicache serve` option of the server, declared once.

Cache settings are not here: they come from `SGLANG_CACHE_DIT_*` over an optional settings profile
(`dicache.settings.profiles.cache_config`: `--profile` or `SGLANG_CACHE_DIT_PROFILE`) at start-up and from each
request's `cache_dit_params`. Everything in `ServerSettings` is enforced inside the ASGI app, so any ASGI host
(uvicorn, Ray Serve) gets it; connection-level limits (`ConnectionLimits`: concurrent connections, keep-alive, request
heads) belong to the host (`dicache.server.runner` applies them to uvicorn).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import field_validator, model_validator

from ..errors import ConfigError
from ..settings.options import FlagOptions, Options, option

API_KEY_ENV = "DICACHE_API_KEY"
"""The API key's environment variable (`--api-key` wins over it)."""

TEXT_LENGTH_MODES: dict[str, str] = {
    "background": "after the server is ready, one length at a time once no request has been in flight for 2 s (a "
    "request waits for at most one such chunk, about 0.05-0.1 s; a request's own lengths not met yet are met while "
    "its prompt is encoded)",
    "before-ready": "before the server is ready (with a plan per length about 22 s for Krea-2 at 1024² on an H200; "
    "with shared plans none is left there after the warm-up)",
    "off": "never",
}
"""`--prepare-text-lengths`: when every prompt length's attention plan is met once (`backend.ready_to_serve`)."""
TextLengthMode = Literal[tuple(TEXT_LENGTH_MODES)]  # the modes, from their declaration above


def read_text_length_mode(value: str | bool) -> str:
    """A `--prepare-text-lengths` value: a mode of `TEXT_LENGTH_MODES`, or true / false (the earlier switch's words,
    for "before-ready" / "off"). Anything else is returned as given, for the declaration to refuse by name."""
    if isinstance(value, bool):
        return "before-ready" if value else "off"
    word = value.strip().lower()
    return {"true": "before-ready", "1": "before-ready", "false": "off", "0": "off"}.get(word, word)


ANSWER_TIMEOUT_S = 10.0
"""Seconds a drain waits for the answers of the generations it stopped (after `drain_grace_s`)."""


def parse_default_size(text: str) -> tuple[int, int]:
    """`--default-size` "WxH" -> (width, height), each side a multiple of 16 and at least 16; ValueError otherwise."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"expected WIDTHxHEIGHT, e.g. 1024x1024, got {text!r}") from None
    if width < 16 or height < 16 or width % 16 or height % 16:
        raise ValueError(f"{text!r} is invalid: each side must be a multiple of 16, at least 16")
    return width, height


class ServerSettings(Options):
    """Bounds every request is checked against; a value outside them is a 400 naming the field.

    Each field is declared once with its `dicache serve` option (`option(flag=..., help=...)`); the command derives
    its options from them (`dicache.commands.fields`). A bad value raises ValueError naming the field, the value
    and what is allowed. Fields without a flag:
        min_side, size_multiple: bounds of `size` "WxH" (each side a multiple of `size_multiple`).
        api_key: when set, `/v1/*` needs `Authorization: Bearer <api_key>` (401 otherwise). Never shown in repr.
        protect_metrics / docs / drain_grace_s / body_timeout_s: see their options.
    """

    model_id: str = option("krea-2", flag="--model-id", help="name listed by /v1/models")
    max_queue: int = option(
        16,
        flag="--max-queue",
        ge=0,
        le=100_000,
        help="requests allowed to wait for a busy worker; more get 429; 0: take requests only when a worker is free",
    )
    workers: int = option(
        2,
        flag="--workers",
        ge=1,
        le=64,
        default_text="2; 1 with the memory options",
        help="requests in flight at once: text encoding, denoising and decoding each run one request at a time on a "
        "thread (and CUDA stream) of their own, so with 2 or more one request's encoding and decoding overlap "
        "another's denoising; outputs do not depend on it",
    )
    request_timeout_s: float = option(
        600.0,
        flag="--timeout",
        gt=0,
        le=86_400,
        unit="seconds",
        help="seconds per request, waiting included; past it 504, and the generation stops at its next transformer "
        "or VAE block, so its worker is busy at most one block longer (one transformer call if the blocks are "
        "compiled); the longest single block is that of the largest allowed --max-side x --max-n request",
    )
    max_n: int = option(4, flag="--max-n", ge=1, le=64, help="images per request")
    min_side: int = option(16, ge=1)
    max_side: int = option(
        2048,
        flag="--max-side",
        ge=16,
        le=8192,
        help="largest image side; the work of one step grows with (side^2 x n)^2",
    )
    size_multiple: int = option(16, ge=1)
    max_steps: int = option(200, flag="--max-steps", ge=1, le=1000, help="most steps")
    max_prompt_chars: int = option(4000, flag="--max-prompt-chars", ge=1, le=1_000_000, help="longest prompt")
    max_body_bytes: int = option(
        1 << 20, flag="--max-body-bytes", ge=1024, le=1 << 30, help="largest request body; larger: 413"
    )
    body_timeout_s: float = option(
        30.0,
        flag="--body-timeout",
        gt=0,
        le=3600,
        unit="seconds",
        help="seconds a request body may take to arrive; then 408",
    )
    api_key: str | None = option(None, repr=False)  # the option is --api-key or DICACHE_API_KEY (commands.serve)
    protect_metrics: bool = option(False, flag="--metrics-auth", help="/metrics needs the API key too")
    docs: bool = option(
        False,
        flag="--docs",
        help="serve /docs and /openapi.json (they list the whole API surface)",
    )
    drain_grace_s: float = option(
        30.0,
        flag="--drain-timeout",
        ge=0,
        le=86_400,
        unit="seconds",
        help="on SIGTERM: new requests get 503 + Retry-After, accepted generations get this many seconds to finish, "
        "the rest get 503, then the process exits 0; a second SIGTERM ends the wait at once. Give the orchestrator "
        "a termination grace period of at least this plus 15 s",
    )

    @model_validator(mode="after")
    def _check_together(self) -> ServerSettings:
        if self.max_side < self.min_side:
            raise ValueError(f"ServerSettings.max_side={self.max_side} must be >= min_side={self.min_side}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("ServerSettings.api_key is empty: give a key or None (no authentication)")
        if self.protect_metrics and self.api_key is None:
            raise ValueError("ServerSettings.protect_metrics needs an api_key")
        return self

    def public(self) -> dict[str, object]:
        """The limits, for `/v1/server_info` (no key)."""
        return {**self.model_dump(exclude={"api_key"}), "api_key_set": self.api_key is not None}


class ConnectionLimits(Options):
    """Connection-level limits of the uvicorn host (each declared with its `dicache serve` option, where it has one).

    shutdown_timeout_s: after the drain, seconds uvicorn waits for connections to finish before cancelling.
    """

    label: ClassVar[str] = "{name}"

    max_connections: int = option(
        1000,
        flag="--max-connections",
        ge=1,
        le=1_000_000,
        help="open connections; at the limit a new connection closes the longest-open idle one (no request in "
        "progress), and new requests get 503 only when every connection has one; each is a file descriptor, and the "
        "soft descriptor limit is raised to fit",
    )
    keep_alive_s: float = option(
        5.0,
        flag="--keep-alive-timeout",
        gt=0,
        le=3600,
        unit="seconds",
        help="seconds an idle keep-alive connection stays open",
    )
    header_timeout_s: float = option(
        10.0,
        flag="--header-timeout",
        gt=0,
        le=3600,
        unit="seconds",
        help="seconds a new connection may take to send its request head; a slower one is closed",
    )
    shutdown_timeout_s: float = option(5.0, gt=0, unit="seconds")


def server_settings(values: Mapping[str, Any], api_key: str | None, environ: Mapping[str, str] | None = None):
    """`ServerSettings` from `dicache serve`'s options (`values` by field name), the key `api_key` (`--api-key`) else
    `DICACHE_API_KEY` of `environ` (default: the process environment). A bad value is a `ConfigError` naming the
    option."""
    env = os.environ if environ is None else environ
    if api_key is not None and not api_key.strip():  # e.g. --api-key "$KEY" with KEY unset
        raise ConfigError("serve: --api-key is empty: give a key, or leave the option out (no authentication)")
    key = api_key or env.get(API_KEY_ENV) or None
    if values.get("protect_metrics") and not key:
        raise ConfigError(f"serve: --metrics-auth needs an API key (--api-key or {API_KEY_ENV})")
    try:
        return ServerSettings(**values, api_key=key)
    except ValueError as exc:
        raise ConfigError(f"serve: {exc}") from None


class ServerProcessOptions(FlagOptions):
    """What a server process sets up beside its model and its limits: `dicache serve`, and each Ray Serve replica
    (`dicache.server.ray.options.ReplicaOptions`). `default_size` is "WxH" text (`parse_default_size`, which the
    command line applies while parsing)."""

    default_size: str | None = option(
        None,
        flag="--default-size",
        read=parse_default_size,
        metavar="WxH",
        default_text="the checkpoint's",
        help="size when a request omits it",
    )
    torch_threads: int | None = option(
        None, flag="--torch-threads", ge=1, default_text="torch's", help="CPU threads per torch op"
    )
    prepare_text_lengths: TextLengthMode = option(
        "background",
        flag="--prepare-text-lengths",
        read=read_text_length_mode,
        help="on CUDA, meet every prompt length's attention plan once at the default size (one length per plan, none "
        "the warm-up met), so that a prompt of a new length costs no attention set-up in its request (38-40 ms on an "
        "H100 otherwise, once per plan): " + "; ".join(f"{mode}: {what}" for mode, what in TEXT_LENGTH_MODES.items()),
    )

    @field_validator("prepare_text_lengths", mode="before")
    @classmethod
    def _text_length_mode(cls, value: Any) -> Any:
        return read_text_length_mode(value) if isinstance(value, (bool, str)) else value

    api_key: str | None = option(
        None,
        flag="--api-key",
        repr=False,
        default_text=f"{API_KEY_ENV}, else none",
        help=f"require 'Authorization: Bearer KEY' on /v1/* (401 otherwise); prefer the {API_KEY_ENV} environment "
        "variable, which other users cannot read from the process list",
    )


class ListenOptions(FlagOptions):
    """Where the single-process server (or the Ray Serve proxy of `dicache serve --ray`) listens, and its log level."""

    host: str = option(
        "127.0.0.1",
        flag="--host",
        help="address to listen on (another address without an API key logs a warning)",
    )
    port: int = option(30000, flag="--port", ge=1, le=65535, help="port")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = option(
        "info", flag="--log-level", help="log level"
    )
