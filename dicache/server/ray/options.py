"""`ReplicaOptions`: what each Ray Serve replica loads (model, variant, precision, device, parallel degrees, loading
and speed options, settings profile, default size, threads, API key): the `dicache serve` options of the same
names, made of their declarations (`ModelChoice`, `DeviceOptions`, `SpeedOptions`, `ParallelOptions`,
`ProfileOption`, `ServerProcessOptions`), so that the command line and the builder take the same names, bounds and
help from one place.

The Serve application builder (`dicache.server.ray_serve:app_builder`) takes its arguments by these names and by
those of `ServerSettings`, `ConnectionLimits` and `RayServeOptions`; the command line parses the same options with
argparse (`dicache.commands.serve`) and builds the same replica (`tests/test_ray_serve_units.py` checks that both
paths agree). `default_gpus`: the GPUs a replica reserves when `--gpus-per-replica` is not given, for both paths.
`RayDriverOptions`: `--ray` and `--ray-address`, the command line's own.
"""

from __future__ import annotations

from ...models.options import DeviceOptions, ModelChoice, SpeedOptions
from ...parallel.options import ParallelOptions
from ...settings.options import FlagOptions, option
from ...settings.profiles import ProfileOption
from ..settings import ServerProcessOptions


class ReplicaOptions(ModelChoice, DeviceOptions, SpeedOptions, ParallelOptions, ProfileOption, ServerProcessOptions):
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
