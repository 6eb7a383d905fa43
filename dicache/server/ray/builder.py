"""The Serve application builder, for Ray's own tools: `serve run dicache.server.ray.builder:app_builder replicas=2
device=cpu`, or `import_path: dicache.server.ray.builder:app_builder` + `args:` in a Serve config / KubeRay
`serveConfigV2` (the earlier path `dicache.server.ray_serve:app_builder` names the same function).

Its args are `dicache serve` options without the dashes (`{"replicas": 2, "max_queue": 8}` means `--replicas 2
--max-queue 8`), checked against their declarations (`BUILDER_OPTIONS`), never parsed as a command line: the
builder builds the same `ReplicaSpec` and `RayServeOptions` as `dicache serve --ray` does from its argv.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError
from ...models.loading import CheckpointError, check_load_format
from ...quantization import parse_quantization
from ...settings.options import option_values
from ...settings.profiles import cache_config as read_cache_config
from ..settings import ConnectionLimits, ServerSettings, parse_default_size, server_settings
from .deployment import build_application
from .options import RayServeOptions, ReplicaOptions, serve_options
from .spec import ReplicaSpec
from .startup import local_cluster_environment

BUILDER_OPTIONS = (ServerSettings, ConnectionLimits, RayServeOptions, ReplicaOptions)
"""The declared options a Serve builder's arguments are checked against, each by its `dicache serve` option name."""


def replica_from_options(
    args: Mapping[str, Any], cluster_gpus: float | None = None
) -> tuple[ReplicaSpec, RayServeOptions]:
    """Builder arguments (`dicache serve` option names without dashes: `{"replicas": 2, "max_queue": 8}`) -> what
    every replica loads and the deployment's `RayServeOptions`. Each name goes to the declared model that has it
    (`BUILDER_OPTIONS`); text is converted by the field's type (`serve run ... replicas=2`). Cache settings are read
    here from `SGLANG_CACHE_DIT_*` over `profile`, once. A bad name or value is a `ConfigError` naming it."""
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
        text_encoder_quantization=None if load.text_encoder_quantization == "none" else load.text_encoder_quantization,
        compile=load.compile,
        compile_artifact=load.compile_artifact,
        artifact_weights=load.artifact_weights,
        prepare_text_lengths=load.prepare_text_lengths,
    )
    return spec, serve_options(split[RayServeOptions], spec, cluster_gpus)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve application builder (see the module doc).

    `args` are `dicache serve` options without the dashes, checked against their declarations
    (`replica_from_options`); cache settings are read here from `SGLANG_CACHE_DIT_*` over `profile`, once, and sent
    to every replica. Called before Ray is initialized (`serve run` with an import path, which then starts a local
    cluster), it sets that cluster's environment (`local_cluster_environment`: the proxy's error middleware and
    timeouts, the workers' priority), except what the environment already sets; elsewhere the cluster's environment
    must set them.
    """
    import ray  # the ray extra: whether this process has started Ray yet

    spec, options = replica_from_options(dict(args or {}))
    if not ray.is_initialized():  # `serve run <module>:app_builder` builds first, then starts a local cluster
        for name, value in local_cluster_environment(options).items():
            os.environ.setdefault(name, value)
    return build_application(spec, options)
