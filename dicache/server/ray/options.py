"""The declared options of `dicache serve --ray` and of the Serve application builder, each field carrying its
`dicache serve` flag, help and bounds, so that the command line and the builder take the same names, bounds and help
from one place:

- `RayServeOptions`: replica count, autoscaling, resources and start-up / health timeouts of the deployment;
- `ReplicaOptions`: what each replica loads (model, variant, precision, device, parallel degrees, loading and speed
  options, settings profile, default size, threads, API key), made of the declarations of the same `dicache serve`
  options (`ModelChoice`, `DeviceOptions`, `SpeedOptions`, `ParallelOptions`, `ProfileOption`,
  `ServerProcessOptions`);
- `RayDriverOptions`: `--ray` and `--ray-address`, the command line's own.

The builder (`builder.app_builder`) takes its arguments by these names and by those of `ServerSettings` and
`ConnectionLimits`; the command line parses the same options with argparse (`dicache.commands.serve`) and builds the
same replica (`tests/test_ray_serve_units.py` checks that both paths agree). `serve_options`: the deployment's
`RayServeOptions` from their values, with `default_gpus` (the GPUs a replica reserves when `--gpus-per-replica` is not
given), for both paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import model_validator

from ...errors import ConfigError
from ...models.options import DeviceOptions, ModelChoice, SpeedOptions, TextEncoderOptions
from ...parallel.options import ParallelOptions
from ...settings.options import FlagOptions, Options, option
from ...settings.profiles import ProfileOption
from ..settings import ServerProcessOptions
from .spec import ReplicaSpec


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


class ReplicaOptions(
    ModelChoice, DeviceOptions, SpeedOptions, TextEncoderOptions, ParallelOptions, ProfileOption, ServerProcessOptions
):
    """The replica's model and how it is loaded. `default_size` is "WxH" text (`parse_default_size`); `quantization`
    and `quantization_exclude` are `dicache.quantization.parse_quantization`'s; `api_key` None: DICACHE_API_KEY."""


class RayDriverOptions(FlagOptions):
    """`dicache serve --ray` itself: whether to serve on Ray, and which cluster (command line only: the builder runs
    inside a Serve deployment already)."""

    ray: bool = option(False, flag="--ray", help="serve with Ray Serve instead of one process")
    ray_address: str | None = option(
        None,
        flag="--ray-address",
        default_text="RAY_ADDRESS, else start a local one",
        help="Ray cluster to deploy onto, e.g. ray://head:10001 or auto",
    )


def default_gpus(device: str | None, world_size: int, cluster_gpus: float | None) -> float:
    """`--gpus-per-replica` when not given: 1 per rank for a cuda device, 0 for another device; without a device, 1
    per rank if the cluster has GPUs (`cluster_gpus`, None: unknown), else 0."""
    if device is not None:
        return float(world_size) if device.startswith("cuda") else 0.0
    return float(world_size) if cluster_gpus else 0.0


def serve_options(values: Mapping[str, Any], spec: ReplicaSpec, cluster_gpus: float | None = None) -> RayServeOptions:
    """The deployment's `RayServeOptions` from their `values` (by field name) for replicas of `spec`; a missing or None
    `gpus_per_replica` is `default_gpus` for the spec's device and ranks on a cluster of `cluster_gpus` GPUs (None:
    unknown). A bad value is a `ConfigError` naming the option."""
    gpus = values.get("gpus_per_replica")
    if gpus is None:
        gpus = default_gpus(spec.device, spec.world_size, cluster_gpus)
    return RayServeOptions(**{**values, "gpus_per_replica": gpus})
