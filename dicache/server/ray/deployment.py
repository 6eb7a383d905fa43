"""The `dicache serve` app on Ray Serve: N replicas of the same OpenAI-compatible server behind one endpoint.

Each replica is a Ray actor that loads its own pipeline (`ReplicaSpec.load_backend`) and serves the unchanged
single-process app, `create_app(backend, settings)`, through `serve.ingress`: endpoints, request validation, limits,
middleware and the error contract are the single-process server's. What Ray adds:

- replicas: a fixed count, or autoscaling between min and max on ongoing requests per replica (`RayServeOptions`);
- resources: `cpus_per_replica` and `gpus_per_replica` (fractions allowed: 0.5 puts two replicas on one GPU); a
  replica with `tp_size × ulysses_degree` > 1 holds one model over that many processes, one GPU each, through a
  STRICT_PACK placement group (`ray_group`);
- routing: Serve's proxy sends a replica at most `workers + max_queue` requests at a time and holds up to
  `max_queue` more itself; its own failures (a replica that died mid-request, a full router queue, its timeout)
  are answered in the OpenAI error shape by `ray_proxy.ServeErrorsMiddleware`;
- `X-Dicache-Replica: <replica id>` on every answer says which replica served it;
- `/metrics` is aggregated across replicas: one scrape returns every live replica's series, labelled
  `replica="<id>"` (`ray_metrics`);
- health: Serve calls `check_health` every `--replica-health-period` s; a replica that does not answer within
  `--replica-health-timeout` s three times in a row, or whose model group lost a rank, is replaced;
- start-up on a busy node: Serve's HTTP proxy gets `--proxy-start-timeout` s to start and its health checks
  `--proxy-health-timeout` s (`proxy_environment`: Serve's controller reads them from its environment), and
  `dicache serve --ray` waits `--replica-start-timeout` s for the replicas; a local cluster runs Ray's workers at
  the starting process's priority (`local_cluster_environment`);
- drain: under `dicache serve --ray`, SIGTERM drains every replica through its app's own `Drain` (503 + Retry-After
  for new requests and `/health`, `--drain-timeout` for accepted generations) before the application is deleted
  (`ray_drain`).

Entry points: `dicache serve --ray --replicas N` (`dicache.commands.serve_ray`), or the application builder
`dicache.server.ray_serve:app_builder` for `serve run` / `serve deploy` / KubeRay's `serveConfigV2`, whose args
are `dicache serve` options (`{"replicas": 2, "max_queue": 8}` means `--replicas 2 --max-queue 8`), checked against
their declarations (`ServerSettings`, `RayServeOptions`, `ray_options.ReplicaOptions`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import model_validator

from ...errors import ConfigError
from ...settings.cache_config import CacheConfig
from ...settings.options import Options, option, option_values
from ...settings.profiles import cache_config as read_cache_config
from ..settings import ANSWER_TIMEOUT_S, ConnectionLimits, ServerSettings, parse_default_size, server_settings
from .options import ReplicaOptions, default_gpus

log = logging.getLogger("dicache.server.ray")

APP_NAME = "dicache"
DEPLOYMENT_NAME = "DicacheServer"
REPLICA_HEADER = "x-dicache-replica"
SHUTDOWN_MARGIN_S = 10.0
"""Seconds Serve waits for a stopping replica beyond the longest request (`request_timeout_s`) or its drain."""
PROXY_CHECKS = 3
"""Failed readiness or health checks in a row after which Serve's controller gives up on its HTTP proxy and
restarts it (Ray 2.60: `PROXY_HEALTH_CHECK_UNHEALTHY_THRESHOLD`, not configurable)."""
PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_HEALTH_ENV = "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"
WORKER_NICENESS_ENV = "RAY_worker_niceness"
"""Ray's setting for how much its worker processes (Serve's controller and proxy, the replicas) lower their own
priority: 15 by default, under which any other busy process on the node takes nearly all the CPU from them."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads and serves (sent to the replicas by pickling).

    `cache_config` None: each replica reads `SGLANG_CACHE_DIT_*` over `profile` from its own environment.
    `device` None: cuda when the replica has GPUs, else cpu.
    """

    settings: ServerSettings = field(default_factory=ServerSettings)
    model: str | None = None
    variant: str | None = None
    dtype: str | None = None
    device: str | None = None
    default_size: tuple[int, int] | None = None
    cache_config: CacheConfig | None = None
    profile: str | None = None
    torch_threads: int | None = None
    tp_size: int = 1
    ulysses_degree: int = 1
    metrics_period_s: float = 2.0
    load_format: str = "auto"
    quantization: Any = None  # a validated `QuantizationSpec` (`--quantization fp8`) or None
    compile: bool = False
    drain_board: str | None = None  # the driver's `ray_drain.DrainBoard` actor; None: no driver to follow

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ulysses_degree

    def load_backend(self, device: str | None = None) -> Any:
        from ..backend import load_backend

        if self.torch_threads is not None:
            import torch

            torch.set_num_threads(self.torch_threads)
        return load_backend(
            self.model,
            self.variant,
            dtype=self.dtype,
            device=device or self.device,
            cache_config=self.cache_config,
            profile=None if self.cache_config is not None else self.profile,
            default_size=self.default_size,
            load_format=self.load_format,
        )

    def apply_speed(self, backend: Any) -> Any:
        """`--quantization` then `--compile` on a loaded (and, for a group, split) backend, as `dicache serve` does;
        with `--compile` the replica warms up before it reports healthy. Returns the backend."""
        if self.quantization is not None:
            backend.pipe.quantize(self.quantization)
        if self.compile:
            backend.pipe.compile()
            log.info("replica warm-up (compile): %s", backend.warm_up())
        return backend


class RayServeOptions(Options):
    """Replica count, autoscaling and resources of the deployment, each declared with its `dicache serve` option.
    Errors name the option (`ConfigError`).

    `max_replicas` None: a fixed `replicas`. Else Serve autoscales between `min_replicas` and `max_replicas`
    (starting at `replicas`), aiming at `target_ongoing_requests` per replica (None: the replica's `workers`).
    `gpus_per_replica` counts every rank of a tp × ulysses replica: it must then be 0 (CPU) or tp × ulysses.
    The timeouts (seconds) hold on a 2-core node with every core busy, where Ray's own (a proxy must start within
    3 × 5 s; health answers within 10 s for the proxy, 30 s for a replica) were missed.
    """

    label: ClassVar[str] = "{flag}"
    error: ClassVar[type[Exception]] = ConfigError

    replicas: int = option(1, flag="--replicas", ge=1, help="replicas (with autoscaling: the initial count)")
    min_replicas: int | None = option(
        None, flag="--min-replicas", ge=0, default_text="1", help="autoscaling: fewest replicas, 0 allowed"
    )
    max_replicas: int | None = option(
        None, flag="--max-replicas", ge=1, help="autoscaling: most replicas; giving it turns autoscaling on"
    )
    target_ongoing_requests: float | None = option(
        None,
        flag="--target-ongoing-requests",
        gt=0,
        default_text="--workers",
        help="autoscaling: requests in progress or queued per replica to aim at",
    )
    cpus_per_replica: float = option(1.0, flag="--cpus-per-replica", gt=0, help="CPUs each replica reserves")
    gpus_per_replica: float = option(
        0.0,
        flag="--gpus-per-replica",
        ge=0,
        default_text="0 with --device cpu, else 1 per rank if the cluster has GPUs, else 0",
        help="GPUs each replica reserves, fractions allowed; with --tp-size × --ulysses-degree = N it must be N",
    )
    proxy_start_timeout_s: float = option(
        90.0,
        flag="--proxy-start-timeout",
        gt=0,
        unit="seconds",
        help="seconds Serve's HTTP proxy has to start (a process that imports Ray) before Serve gives up on it; "
        "Ray alone allows 15",
    )
    proxy_health_timeout_s: float = option(
        30.0,
        flag="--proxy-health-timeout",
        gt=0,
        unit="seconds",
        help="seconds Serve's running HTTP proxy has to answer a health check, every 10 s; 3 missed in a row "
        "restart it; Ray alone allows 10",
    )
    replica_health_period_s: float = option(
        10.0, flag="--replica-health-period", gt=0, unit="seconds", help="seconds between health checks of a replica"
    )
    replica_health_timeout_s: float = option(
        60.0,
        flag="--replica-health-timeout",
        gt=0,
        unit="seconds",
        help="seconds a replica has to answer a health check; 3 missed in a row replace it; Ray alone allows 30",
    )
    replica_start_timeout_s: float = option(
        900.0,
        flag="--replica-start-timeout",
        gt=0,
        unit="seconds",
        help="seconds dicache serve --ray waits for every replica to load its model and start, then exits 1",
    )

    @model_validator(mode="after")
    def _check_autoscaling(self) -> RayServeOptions:
        if self.min_replicas is not None and self.max_replicas is None:
            raise ConfigError("--min-replicas needs --max-replicas (autoscaling between the two)")
        if self.max_replicas is not None:
            low = 1 if self.min_replicas is None else self.min_replicas
            if not low <= self.replicas <= self.max_replicas:
                raise ConfigError(
                    f"--replicas={self.replicas} is invalid with autoscaling: the initial replica count must be "
                    f"between --min-replicas={low} and --max-replicas={self.max_replicas}"
                )
        elif self.target_ongoing_requests is not None:
            raise ConfigError("--target-ongoing-requests needs --max-replicas (it steers autoscaling)")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None


def proxy_environment(options: RayServeOptions) -> dict[str, str]:
    """The environment variables through which Serve's controller times its HTTP proxy (read once, when the
    controller process imports Ray Serve): each of the `PROXY_CHECKS` readiness checks in a row gets
    `proxy_start_timeout_s / PROXY_CHECKS` seconds, each health check `proxy_health_timeout_s`."""
    return {
        PROXY_READY_ENV: repr(options.proxy_start_timeout_s / PROXY_CHECKS),
        PROXY_HEALTH_ENV: repr(options.proxy_health_timeout_s),
    }


def local_cluster_environment(options: RayServeOptions) -> dict[str, str]:
    """The environment a local Ray cluster started for dicache must inherit from the process that starts it: Serve's
    errors in the OpenAI shape (`ray_proxy`), the proxy's timeouts (`proxy_environment`), and Ray's workers at that
    process's own priority (not 15 lower), so that a busy node shares its CPU with them fairly."""
    from .proxy import CALLBACK_ENV, CALLBACK_PATH

    return {CALLBACK_ENV: CALLBACK_PATH, WORKER_NICENESS_ENV: "0", **proxy_environment(options)}


def gpus_per_rank(spec: ReplicaSpec, options: RayServeOptions) -> float:
    """GPUs each model rank reserves; checks that the GPU count fits the replica's tp × ulysses group."""
    world = spec.world_size
    gpus = options.gpus_per_replica
    if world > 1 and gpus not in (0, world):
        raise ConfigError(
            f"--gpus-per-replica={gpus:g} is invalid with --tp-size {spec.tp_size} × --ulysses-degree "
            f"{spec.ulysses_degree}: each of the {world} ranks takes one whole GPU, so it must be {world} "
            "(or 0 to run the group on CPUs)"
        )
    if gpus and spec.device is not None and not spec.device.startswith("cuda"):
        raise ConfigError(f"--gpus-per-replica={gpus:g} needs a CUDA device, but --device={spec.device!r}")
    return gpus / world if world > 1 else gpus


def replica_resources(spec: ReplicaSpec, options: RayServeOptions) -> dict[str, float]:
    """CPUs and GPUs one replica reserves, all its ranks included (rank 0 `cpus_per_replica`, the others 1 CPU)."""
    return {
        "CPU": options.cpus_per_replica + (spec.world_size - 1),
        "GPU": gpus_per_rank(spec, options) * spec.world_size,
    }


def check_fits(spec: ReplicaSpec, options: RayServeOptions, cluster: dict[str, float], where: str) -> None:
    """Raise ConfigError naming the option when the initial replicas do not fit in `cluster` (its total resources).

    For a cluster that cannot grow (the local one `dicache serve --ray` starts): Serve would otherwise wait forever
    for resources that never come.
    """
    need = replica_resources(spec, options)
    flags = {"CPU": "--cpus-per-replica", "GPU": "--gpus-per-replica"}
    for kind in ("GPU", "CPU"):
        have = float(cluster.get(kind, 0.0))
        total = need[kind] * options.replicas
        if total <= have + 1e-6:  # fractions: 10 × 0.1 GPU fit on one GPU
            continue
        per = f"{need[kind]:g} {kind}(s) per replica ({flags[kind]}"
        per += f", --tp-size × --ulysses-degree = {spec.world_size})" if spec.world_size > 1 else ")"
        raise ConfigError(
            f"--replicas={options.replicas} × {per} = {total:g} {kind}(s), but {where} has {have:g}: "
            f"lower --replicas or {flags[kind]}" + (", or serve on CPUs with --device cpu" if kind == "GPU" else "")
        )


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
        from .group import placement_bundles

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
    """One replica: loads the pipeline (or its tp × ulysses group), then serves `create_app` (see the module doc)."""

    def __init__(self, spec: ReplicaSpec, gpus_per_rank: float = 0.0) -> None:
        from ray import serve

        from .metrics import ClusterMetrics

        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.spec = spec
        device = spec.device or ("cuda" if gpus_per_rank else "cpu")
        if spec.world_size > 1:
            from .group import load_group_backend

            self.backend = load_group_backend(
                _with_device(spec, device), spec.tp_size, spec.ulysses_degree, gpus_per_rank
            )
        else:
            self.backend = spec.apply_speed(spec.load_backend(device=device))
        self.metrics = ClusterMetrics(self.replica, context.app_name, period_s=spec.metrics_period_s)
        self.metrics.start()
        log.info("replica %s (pid %d) loaded the pipeline on %s", self.replica, os.getpid(), device)

    def __serve_build_asgi_app__(self) -> Any:
        from .. import create_app

        background = []
        if self.spec.drain_board is not None:  # follow the driver's drain (`dicache serve --ray` on SIGTERM)
            from .drain import follow
            from .metrics import NAMESPACE

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


def _with_device(spec: ReplicaSpec, device: str) -> ReplicaSpec:
    import dataclasses

    return dataclasses.replace(spec, device=device)


def build_application(spec: ReplicaSpec, options: RayServeOptions) -> Any:
    """The Serve application (`serve.run(build_application(...), route_prefix="/")`)."""
    from ray import serve

    config = deployment_options(spec, options)
    ingress = serve.ingress()(DicacheReplica)
    deployment = serve.deployment(ingress, **config)
    return deployment.bind(spec, gpus_per_rank(spec, options))


# ---------------------------------------------------------------------- the application builder (serve run / KubeRay)
def args_to_argv(args: dict[str, Any]) -> list[str]:
    """Builder args -> `dicache serve` options: `{"max_queue": 8, "ray": True}` -> `["--max-queue", "8", "--ray"]`.

    True is a bare flag, False / None leave the option out, a list repeats the option's values.
    """
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-").lstrip("-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


BUILDER_OPTIONS = (ServerSettings, ConnectionLimits, RayServeOptions, ReplicaOptions)
"""The declared options a Serve builder's arguments are checked against, each by its `dicache serve` option name."""


def replica_from_options(
    args: Mapping[str, Any], cluster_gpus: float | None = None
) -> tuple[ReplicaSpec, RayServeOptions]:
    """Builder arguments (`dicache serve` option names without dashes: `{"replicas": 2, "max_queue": 8}`) -> what
    every replica loads and the deployment's `RayServeOptions`. Each name goes to the declared model that has it
    (`BUILDER_OPTIONS`); text is converted by the field's type (`serve run ... replicas=2`). Cache settings are read
    here from `SGLANG_CACHE_DIT_*` over `profile`, once. A bad name or value is a `ConfigError` naming it."""
    # models.loading and quantization import torch, which building the application does not otherwise need
    from ...models.loading import CheckpointError, check_load_format
    from ...quantization import parse_quantization

    split = option_values(args, BUILDER_OPTIONS, ConfigError)
    load = ReplicaOptions(**split[ReplicaOptions])
    try:  # checked as the command line checks them; under Ray, Serve's proxy holds the connections
        ConnectionLimits(**split[ConnectionLimits])
        default_size = None if load.default_size is None else parse_default_size(load.default_size)
        check_load_format(load.load_format)
    except (ValueError, CheckpointError) as exc:
        raise ConfigError(f"Serve application args: {exc}") from None
    spec = ReplicaSpec(
        settings=server_settings(split[ServerSettings], load.api_key),
        model=load.model,
        variant=load.variant,
        dtype=load.dtype,
        device=load.device,
        default_size=default_size,
        cache_config=read_cache_config(load.profile),
        torch_threads=load.torch_threads,
        tp_size=load.tp_size,
        ulysses_degree=load.ulysses_degree,
        load_format=load.load_format,
        quantization=parse_quantization(load.quantization, load.quantization_exclude),
        compile=load.compile,
    )
    deployment = split[RayServeOptions]
    if deployment.get("gpus_per_replica") is None:
        deployment["gpus_per_replica"] = default_gpus(spec.device, spec.world_size, cluster_gpus)
    return spec, RayServeOptions(**deployment)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve application builder: `serve run dicache.server.ray_serve:app_builder replicas=2 device=cpu`, or
    `import_path: dicache.server.ray_serve:app_builder` + `args:` in a Serve config / KubeRay `serveConfigV2`.

    `args` are `dicache serve` options without the dashes, checked against their declarations
    (`replica_from_options`); cache settings are read here from `SGLANG_CACHE_DIT_*` over `profile`, once, and sent
    to every replica. Called before Ray is initialized (`serve run` with an import path, which then starts a local
    cluster), it sets that cluster's environment (`local_cluster_environment`: the proxy's error middleware and
    timeouts, the workers' priority), except what the environment already sets; elsewhere the cluster's environment
    must set them.
    """
    import ray

    spec, options = replica_from_options(dict(args or {}))
    if not ray.is_initialized():  # `serve run <module>:app_builder` builds first, then starts a local cluster
        for name, value in local_cluster_environment(options).items():
            os.environ.setdefault(name, value)
    return build_application(spec, options)
