"""The Serve deployment of `dicache serve`'s app: its `serve.deployment(...)` arguments (`deployment_options`, pure),
the replica actor (`DicacheReplica`: loads the pipeline, or its tp × ulysses group, and serves `create_app` through
`serve.ingress`, with `X-Dicache-Replica` on every answer and `/metrics` for every replica), and the application
(`build_application`). The package docstring says what Ray adds to the single-process server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from ..app import create_app
from ..settings import ANSWER_TIMEOUT_S
from .drain import follow
from .group import load_group_backend, placement_bundles
from .metrics import NAMESPACE, ClusterMetrics
from .options import RayServeOptions
from .resources import gpus_per_rank
from .spec import ReplicaSpec

log = logging.getLogger("dicache.server.ray")

APP_NAME = "dicache"
DEPLOYMENT_NAME = "DicacheServer"
REPLICA_HEADER = "x-dicache-replica"
SHUTDOWN_MARGIN_S = 10.0
"""Seconds Serve waits for a stopping replica beyond the longest request (`request_timeout_s`) or its drain."""


def deployment_options(spec: ReplicaSpec, options: RayServeOptions) -> dict[str, Any]:
    """The keyword arguments of `serve.deployment(...)` for `spec` and `options` (pure: no Ray needed)."""
    settings = spec.settings
    per_rank = gpus_per_rank(spec, options)
    actor: dict[str, Any] = {"num_cpus": options.cpus_per_replica}
    if per_rank:
        actor["num_gpus"] = per_rank
    config: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": actor,
        # a replica never holds more than it can queue; the rest waits in Serve's router (then 429)
        "max_ongoing_requests": settings.workers + settings.max_queue,
        "max_queued_requests": max(1, settings.max_queue),
        # a stopping replica (scale-down, node drain, redeploy) finishes its longest request, or its drain, first
        "graceful_shutdown_timeout_s": max(settings.request_timeout_s, settings.drain_grace_s + ANSWER_TIMEOUT_S)
        + SHUTDOWN_MARGIN_S,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": options.replica_health_period_s,
        "health_check_timeout_s": options.replica_health_timeout_s,
    }
    if spec.world_size > 1:
        config["placement_group_bundles"] = placement_bundles(spec.world_size, options.cpus_per_replica, per_rank)
        config["placement_group_strategy"] = "STRICT_PACK"
    if options.autoscaling:
        config["autoscaling_config"] = {
            "min_replicas": 1 if options.min_replicas is None else options.min_replicas,
            "max_replicas": options.max_replicas,
            "initial_replicas": options.replicas,
            "target_ongoing_requests": options.target_ongoing_requests or float(settings.workers),
        }
    else:
        config["num_replicas"] = options.replicas
    return config


class ReplicaHeaderMiddleware:
    """Pure ASGI middleware: `X-Dicache-Replica: <replica id>` on every HTTP answer."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


class DicacheReplica:
    """One replica: loads the pipeline (or its tp × ulysses group), then serves `create_app` (see the package doc)."""

    def __init__(self, spec: ReplicaSpec, gpus_per_rank: float = 0.0) -> None:
        from ray import serve  # the ray extra: the replica runs inside Serve

        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.spec = spec
        device = spec.device or ("cuda" if gpus_per_rank else "cpu")
        if spec.world_size > 1:
            self.backend = load_group_backend(
                dataclasses.replace(spec, device=device), spec.tp_size, spec.ulysses_degree, gpus_per_rank
            )
        else:
            self.backend = spec.apply_speed(spec.load_backend(device=device))
        self.metrics = ClusterMetrics(self.replica, context.app_name, period_s=spec.metrics_period_s)
        self.metrics.start()
        log.info("replica %s (pid %d) loaded the pipeline on %s", self.replica, os.getpid(), device)

    def __serve_build_asgi_app__(self) -> Any:
        background = []
        if self.spec.drain_board is not None:  # follow the driver's drain (`dicache serve --ray` on SIGTERM)
            board, replica = self.spec.drain_board, self.replica
            background.append(lambda app: follow(board, NAMESPACE, replica, app.state.drain))
        app = create_app(self.backend, self.spec.settings, metrics=self.metrics, background=background)
        app.add_middleware(ReplicaHeaderMiddleware, replica=self.replica)
        return app

    def check_health(self) -> None:
        check = getattr(self.backend, "check", None)
        if check is not None:
            check()

    def __del__(self) -> None:
        # Serve ran the app's shutdown (the queue drained) before this
        metrics, backend = getattr(self, "metrics", None), getattr(self, "backend", None)
        if metrics is not None:
            metrics.stop()
        if backend is not None:
            backend.close()


def build_application(spec: ReplicaSpec, options: RayServeOptions) -> Any:
    """The Serve application (`serve.run(build_application(...), route_prefix="/")`)."""
    from ray import serve  # the ray extra: only building the application needs it

    config = deployment_options(spec, options)
    ingress = serve.ingress()(DicacheReplica)
    deployment = serve.deployment(ingress, **config)
    return deployment.bind(spec, gpus_per_rank(spec, options))
