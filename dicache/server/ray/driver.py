"""The driver of `dicache serve --ray`, once the command line has built what to serve (`ReplicaSpec`) and how to
deploy it (`RayServeOptions` values): `serve_on_ray`.

Without an address (nor RAY_ADDRESS) it starts a local Ray cluster; with one it deploys onto that cluster. It starts
Serve and the application (`startup`: within --proxy-start-timeout and --replica-start-timeout, else a one-line
`StartupError`), then runs until SIGINT / SIGTERM, which drains every replica as the single-process server drains
(`drain`: new requests and `/health` get 503 + Retry-After, accepted generations get `--drain-timeout` seconds, the
rest get 503; a second signal ends the grace period at once, a third stops waiting), then deletes the application.
A signal while the replicas are still starting stops the start-up. Either way it returns 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Mapping
from typing import Any

import ray
from ray import serve

from ...errors import StartupError
from ..settings import ANSWER_TIMEOUT_S
from .deployment import APP_NAME, SHUTDOWN_MARGIN_S, build_application, deployment_options
from .drain import begin_drain, start_board, wait_drained
from .drain import board_name as drain_board_name
from .metrics import NAMESPACE, board_name
from .options import serve_options
from .resources import check_fits
from .spec import ReplicaSpec
from .startup import deploy, local_cluster_environment, start_serve

log = logging.getLogger("dicache.server")

DRAIN_MARGIN_S = 3.0
"""Seconds the driver waits for the replicas' drains beyond `--drain-timeout` + their answer timeout."""


class _StoppedStarting(BaseException):
    """SIGINT / SIGTERM while the application was being deployed (a BaseException, so that no handler in Ray's code
    path mistakes it for a failure)."""


class _Signals:
    """SIGINT / SIGTERM to the driver: the first stops the start-up (raising `_StoppedStarting` where the driver
    waits) or, once serving, sets `stop`; a second hurries the drain, a third stops waiting for it (`count`)."""

    def __init__(self) -> None:
        self.count, self.starting, self.stop = 0, True, threading.Event()

    def __call__(self, *_: Any) -> None:
        self.count += 1
        self.stop.set()
        if self.starting:  # abort the deployment in progress (serve.run waits for every replica to load)
            self.starting = False
            raise _StoppedStarting

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):  # before Serve starts: Ray's own handler would abort the process
            signal.signal(sig, self)


def serve_on_ray(spec: ReplicaSpec, deployment: Mapping[str, Any], host: str, port: int, address: str | None) -> int:
    """Serve `spec`'s replicas on Ray, Serve's proxy listening on `host`:`port`, until a signal (module doc).

    `deployment`: `RayServeOptions` values by field name; a missing or None `gpus_per_replica` is `default_gpus` for
    the cluster's GPUs. `address`: the Ray cluster (None: RAY_ADDRESS, else a local cluster, which the replicas must
    fit). A bad option is a `ConfigError` before Ray starts.
    """
    checked = serve_options(deployment, spec, cluster_gpus=0)
    deployment_options(spec, checked)  # every option checked before Ray starts
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None:  # a local cluster inherits this environment (proxy errors and timeouts, workers' priority)
        for name, value in {**local_cluster_environment(checked), "RAY_USAGE_STATS_ENABLED": "0"}.items():
            os.environ.setdefault(name, value)
        context = ray.init(include_dashboard=False, logging_level=logging.WARNING)
    else:
        context = ray.init(address=address, logging_level=logging.WARNING)
    print(f"Ray cluster at {context.address_info.get('gcs_address') or address}", flush=True)
    signals = _Signals()
    signals.install()
    try:
        try:
            options = serve_options(deployment, spec, cluster_gpus=ray.cluster_resources().get("GPU", 0))
            if address is None:  # a local cluster cannot grow: refuse replicas it cannot place, before deploying
                check_fits(spec, options, ray.cluster_resources(), "the local Ray cluster")
            start_serve(
                serve,
                options,
                http_options={
                    "host": host,
                    "port": port,
                    # backstop for time spent in Serve's own queue; the app's own timeout answers first
                    "request_timeout_s": spec.settings.request_timeout_s + SHUTDOWN_MARGIN_S,
                },
            )
            board = start_board(drain_board_name(APP_NAME), NAMESPACE)
            if board is not None:  # else the replicas do not drain first: Serve's own graceful shutdown only
                spec = dataclasses.replace(spec, drain_board=drain_board_name(APP_NAME))
            deploy(serve, build_application(spec, options), options)
            signals.starting = False
        except _StoppedStarting:
            print("stopped while starting: removing the deployment", flush=True)
            with contextlib.suppress(Exception):  # nothing deployed yet, or Serve not started
                serve.delete(APP_NAME)
            return 0
        except StartupError:
            with contextlib.suppress(Exception):  # what was deployed, if anything
                serve.delete(APP_NAME)
            raise
        what = f"{options.replicas} replica(s)"
        if options.autoscaling:
            what += f", autoscaling {options.min_replicas or 1}..{options.max_replicas}"
        print(f"dicache on Ray Serve: {what} at http://{host}:{port} (Ctrl-C or SIGTERM stops)", flush=True)
        while not signals.stop.wait(1.0):
            pass
        print("stopping: every replica finishes its requests first", flush=True)
        drain(board, spec.settings.drain_grace_s, signals)
        serve.delete(APP_NAME)
    finally:
        for name in (board_name(APP_NAME), drain_board_name(APP_NAME)):
            with contextlib.suppress(ValueError):  # ValueError: not created (no replica got that far, or no deploy)
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        if address is None:
            serve.shutdown()
        ray.shutdown()
    return 0


def drain(board: Any, grace_s: float, signals: _Signals) -> None:
    """Drain every replica through the drain `board` (None: none could be created, and Serve's own graceful shutdown
    finishes the requests) and wait for them: `grace_s` for accepted generations, then their answers; further
    `signals` hurry the replicas, then stop the wait."""
    try:
        if board is not None:
            unaware = begin_drain(board)
            if unaware:
                log.warning("drain: replica(s) %s not reached (dead or busy)", unaware)
            print(
                f"draining: every replica answers new requests 503; accepted generations have {grace_s:g} s "
                "(signal again to stop them now, a third time to stop waiting)",
                flush=True,
            )
        pending = (
            {}
            if board is None
            else wait_drained(
                board,
                grace_s + ANSWER_TIMEOUT_S + DRAIN_MARGIN_S,
                hurry=lambda: signals.count >= 2,
                stop=lambda: signals.count >= 3,
            )
        )
    except Exception as exc:  # the board died: Serve's own graceful shutdown still finishes the requests
        log.warning("drain: the drain board failed (%s)", exc)
        pending = {"?": 0}
    if pending:
        log.warning("drain: replica(s) %s not drained in time", sorted(pending))
    elif board is not None:
        print("drained: every replica answered its requests", flush=True)
