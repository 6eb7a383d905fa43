"""Run the app with uvicorn as `dicache serve` does: connection limits, and SIGTERM -> drain -> exit 0.

`DrainingServer` is a `uvicorn.Server` whose first SIGTERM / SIGINT starts the app's drain (`app.state.drain`) while
the listener stays open, so clients arriving during the drain get 503 with `Retry-After` rather than "connection
refused". Once the drain is done, uvicorn closes the listener and idle connections, and cancels whatever is left
after `ConnectionLimits.shutdown_timeout_s`. A second signal ends the grace period at once (unfinished generations
are answered 503); a third exits without waiting. The signal is not re-raised, so the process exits 0 and the
caller's cleanup (`backend.close()`) runs.

Connection limits (`ConnectionLimits`): at most `max_connections` open connections / requests (uvicorn's
`limit_concurrency`: beyond it requests are answered 503 and their connection closed), idle keep-alive connections
closed after `keep_alive_s`, and connections that have not completed a request's headers within `header_timeout_s`
closed. The body-read timeout is the app's (`ServerSettings.body_timeout_s`), so it also holds under other hosts.

Idle connections never crowd out requests: when a new connection makes `max_connections` open, the server closes the
longest-open idle one at once (`IdleShedding`: one with no request in progress, a connection that never sent a
request head first, then one kept alive between requests), as nginx reuses its idle keep-alive connections when it
runs out. So 1,000 idle connections (the default limit) held open by one client delay no one else's request; only
when every open connection has a request in progress do new requests get 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import ipaddress
import logging
import signal
import threading
import time
from collections.abc import Generator
from typing import Any

import uvicorn

try:
    import resource
except ImportError:  # not POSIX: the descriptor limit is left alone
    resource = None

from ..errors import ConfigError
from .settings import ConnectionLimits, ServerSettings

__all__ = ["ConnectionLimits", "DrainingServer", "ensure_descriptors", "exposure_warnings", "serve"]

log = logging.getLogger("dicache.server")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
FD_RESERVE = 128  # descriptors kept for everything but client connections (model files, logs, pipes, ...)


def ensure_descriptors(max_connections: int) -> int:
    """Make sure the process may open `max_connections` sockets (each client connection is one file descriptor):
    raise the soft `RLIMIT_NOFILE` up to the hard one if needed; `ConfigError` naming `--max-connections` if even the
    hard limit is too low. Returns the soft limit in force."""
    if resource is None:  # not POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ConfigError(
                f"--max-connections={max_connections} is invalid: the process may open {hard} files (ulimit -Hn), "
                f"so at most {max(1, hard - FD_RESERVE)} connections"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        soft = needed
    return soft


def exposure_warnings(host: str, settings: ServerSettings) -> list[str]:
    """Warnings for a server reachable beyond this machine without an API key."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback or settings.api_key:
        return []
    return [
        f"--host {host} is reachable from other machines and no API key is set: anyone who can connect may generate "
        "images; set DICACHE_API_KEY (or --api-key)"
    ]


def uvicorn_config(app: Any, limits: ConnectionLimits, log_level: str = "info", **kwargs: Any) -> uvicorn.Config:
    return IdleShedding(
        app,
        lifespan="on",
        log_level=log_level,
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=limits.keep_alive_s,
        timeout_graceful_shutdown=limits.shutdown_timeout_s,
        **kwargs,
    )


class IdleShedding(uvicorn.Config):
    """uvicorn's configuration with its HTTP protocol class extended (`shedding_protocol`): a connection that makes
    `limit_concurrency` connections open closes the longest-open idle one (see the module docstring)."""

    def load(self) -> None:
        super().load()
        self.http_protocol_class = shedding_protocol(self.http_protocol_class)


def is_idle(connection: Any) -> bool:
    """Whether a uvicorn HTTP connection has no request in progress: none began (no complete request head yet), or
    the last one is answered and the connection waits for the next (its keep-alive timer runs)."""
    waiting_for_next = getattr(connection, "timeout_keep_alive_task", None) is not None
    return getattr(connection, "cycle", True) is None or waiting_for_next


def shed_idle(connections: set[Any], count: int, keep: Any) -> int:
    """Close up to `count` idle connections other than `keep`: those that never sent a request head first, then
    those kept alive between requests, the longest open first. Returns how many were closed."""
    idle = [c for c in connections if c is not keep and is_idle(c) and getattr(c, "transport", None) is not None]
    victims = heapq.nsmallest(
        count, idle, key=lambda c: (getattr(c, "cycle", None) is not None, getattr(c, "opened_at", 0.0))
    )
    for connection in victims:
        connection.transport.close()
        connections.discard(connection)  # now: its `connection_lost` may come after the new request's head (uvloop)
    return len(victims)


@functools.cache
def shedding_protocol(base: type) -> type:
    """`base` (uvicorn's HTTP protocol class) whose `connection_made` sheds an idle connection when it makes
    `config.limit_concurrency` connections open, so that its request will not be refused for them."""

    def connection_made(self: Any, transport: Any) -> None:
        base.connection_made(self, transport)
        self.opened_at = time.monotonic()
        limit = getattr(self.config, "limit_concurrency", None)
        connections = self.server_state.connections
        if limit is not None and len(connections) >= limit:
            shed_idle(connections, len(connections) - limit + 1, keep=self)

    return type(f"IdleShedding{base.__name__}", (base,), {"connection_made": connection_made})


class DrainingServer(uvicorn.Server):
    """uvicorn with the drain-first shutdown and the header timeout described in the module docstring."""

    def __init__(self, config: uvicorn.Config, limits: ConnectionLimits | None = None) -> None:
        super().__init__(config)
        self.limits = limits or ConnectionLimits()
        self.signals = 0
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None
        self._opened: dict[Any, float] = {}  # connection -> when first seen without a request

    @property
    def drain(self) -> Any:
        app = self.config.app
        return getattr(getattr(app, "state", None), "drain", None)

    def request_drain(self) -> None:
        """Begin the shutdown (drain, then exit) without waiting; safe from any thread."""
        self._drain_requested = True

    def hurry(self) -> None:
        """End the drain's grace period now."""
        self._drain_requested = True
        if self.drain is not None:
            self.drain.hurry()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.signals += 1
        if self.signals == 1:
            log.info("%s: draining (send it again to stop unfinished generations now)", signal.Signals(sig).name)
            self.request_drain()
        elif self.signals == 2:
            log.warning("%s again: stopping unfinished generations now", signal.Signals(sig).name)
            self.hurry()
        else:
            self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())
        if counter % 10 == 0:
            self._close_slow_header_connections()
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        if self.drain is not None:
            await self.drain.run()
        self.should_exit = True

    def _close_slow_header_connections(self) -> None:
        """Close connections that opened more than `header_timeout_s` ago and never completed a request head."""
        now = time.monotonic()
        connections = getattr(getattr(self, "server_state", None), "connections", set())
        for connection in list(self._opened):
            if connection not in connections:
                del self._opened[connection]
        for connection in list(connections):
            if getattr(connection, "cycle", True) is not None:  # a request head arrived (or unknown protocol)
                self._opened.pop(connection, None)
                continue
            first_seen = self._opened.setdefault(connection, now)
            transport = getattr(connection, "transport", None)
            if now - first_seen >= self.limits.header_timeout_s and transport is not None:
                transport.close()
                del self._opened[connection]


def serve(app: Any, host: str, port: int, limits: ConnectionLimits, log_level: str = "info") -> DrainingServer:
    """Serve `app` on host:port until a signal and a drain end it; returns the stopped server (never raises on
    SIGTERM / SIGINT)."""
    ensure_descriptors(limits.max_connections)
    server = DrainingServer(uvicorn_config(app, limits, log_level, host=host, port=port), limits)
    server.run()
    return server
