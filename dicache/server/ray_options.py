"""`ReplicaOptions`: what each Ray Serve replica loads (model, variant, precision, device, parallel degrees, loading
and speed options, settings profile, API key), declared with the `dicache serve` option of the same name.

The Serve application builder (`dicache.server.ray_serve:app_builder`) takes its arguments by these names and by
those of `ServerSettings`, `ConnectionLimits` and `RayServeOptions`; the command line parses the same options with
argparse (`dicache.commands.serve`) and builds the same replica (`tests/test_ray_serve_units.py` checks that both
paths agree). Bounds the command line checks while parsing are declared here for the builder. `default_gpus`: the
GPUs a replica reserves when `--gpus-per-replica` is not given, for both paths.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from ..errors import ConfigError
from ..settings.options import Options, option


class ReplicaOptions(Options):
    """The replica's model and how it is loaded. `default_size` is "WxH" text (`parse_default_size`); `quantization`
    and `quantization_exclude` are `dicache.quantization.parse_quantization`'s; `api_key` None: DICACHE_API_KEY."""

    label: ClassVar[str] = "{flag}"
    error: ClassVar[type[Exception]] = ConfigError

    model: str | None = option(None, flag="--model")
    variant: Literal["turbo", "raw"] | None = option(None, flag="--variant")
    dtype: str | None = option(None, flag="--dtype")
    device: str | None = option(None, flag="--device")
    default_size: str | None = option(None, flag="--default-size")
    profile: str | None = option(None, flag="--profile")
    torch_threads: int | None = option(None, flag="--torch-threads", ge=1)
    tp_size: int = option(1, flag="--tp-size", ge=1)
    ulysses_degree: int = option(1, flag="--ulysses-degree", ge=1)
    load_format: str = option("auto", flag="--load-format")
    quantization: str = option("none", flag="--quantization")
    quantization_exclude: list[str] | None = option(None, flag="--quantization-exclude")
    compile: bool = option(False, flag="--compile")
    api_key: str | None = option(None, flag="--api-key", repr=False)


def default_gpus(device: str | None, world_size: int, cluster_gpus: float | None) -> float:
    """`--gpus-per-replica` when not given: 1 per rank for a cuda device, 0 for another device; without a device, 1
    per rank if the cluster has GPUs (`cluster_gpus`, None: unknown), else 0."""
    if device is not None:
        return float(world_size) if device.startswith("cuda") else 0.0
    return float(world_size) if cluster_gpus else 0.0
