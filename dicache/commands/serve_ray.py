"""`dicache serve --ray`: the same server as N Ray Serve replicas behind one endpoint (`dicache.server.ray`).

This module reads the command line: the Ray options (`add_ray_arguments`, from their declarations), the replica
they describe (`replica_spec_from_args`), the deployment's options (`serve_options_from_args`) and what to warn
about; then the driver (`dicache.server.ray.driver.serve_on_ray`) starts the replicas, serves until SIGINT /
SIGTERM, drains them and exits 0. A start-up that fails (Serve's HTTP proxy not up within --proxy-start-timeout,
replicas not up within --replica-start-timeout, a replica that cannot load) is one line saying what failed and which
option to raise, with exit status 1 (`StartupError`). Nothing here imports Ray unless `--ray` is given.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ..errors import ConfigError, DicacheError
from ..parallel import check_degrees
from ..server.ray.options import RayDriverOptions, RayServeOptions, ReplicaOptions, serve_options
from ..server.ray.spec import ReplicaSpec
from ..server.settings import ConnectionLimits, ServerSettings
from ..settings.profiles import cache_config as read_cache_config
from ..settings.profiles import describe_profile
from .fields import add_options, values_from_args
from .memory import memory_flags, offload_settings
from .serve_args import limits_from_args, settings_from_args
from .speed import speed_spec, text_encoder_quantization


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Ray Serve (--ray)",
        "serve N replicas of this server behind one endpoint on a Ray cluster (needs `pip install 'dicache[ray]'`); "
        "--tp-size / --ulysses-degree then split each replica's model over that many GPUs (no torchrun)",
    )
    add_options(group, RayDriverOptions)
    add_options(group, RayServeOptions, checked=False)  # the options' own messages name the flag and the bound


def replica_spec_from_args(args: argparse.Namespace, cache_config: Any) -> ReplicaSpec:
    if offload_settings(args).any:
        raise ConfigError(
            f"dicache serve --ray: the memory options ({', '.join(memory_flags())}) are not supported on Ray "
            "replicas; run the single-process server for them"
        )
    return ReplicaSpec(
        load_format=args.load_format,
        quantization=speed_spec(args),
        text_encoder_quantization=text_encoder_quantization(args),
        compile=args.compile,
        compile_artifact=args.compile_artifact,
        artifact_weights=args.artifact_weights,
        prepare_text_lengths=args.prepare_text_lengths,
        settings=settings_from_args(args),
        model=args.model,
        variant=args.variant,
        dtype=args.dtype,
        device=args.device,
        default_size=args.default_size,
        cache_config=cache_config,
        torch_threads=args.torch_threads,
        tp_size=args.tp_size,
        ulysses_degree=args.ulysses_degree,
    )


def serve_options_from_args(
    args: argparse.Namespace, spec: ReplicaSpec, cluster_gpus: float | None = None
) -> RayServeOptions:
    """`RayServeOptions` from the options; `cluster_gpus` (the cluster's GPU count, when known) picks the default
    of --gpus-per-replica."""
    check_degrees(args.tp_size * args.ulysses_degree, args.tp_size, args.ulysses_degree)  # each an integer >= 1
    return serve_options(values_from_args(args, RayServeOptions), spec, cluster_gpus)


def args_to_argv(args: dict[str, Any]) -> list[str]:
    """Serve builder args -> the `dicache serve` command line that means the same: `{"max_queue": 8, "ray": True}`
    -> `["--max-queue", "8", "--ray"]` (the builder itself takes them as declared options, `replica_from_options`).

    True is a bare flag; False leaves the option out, or says `false` to a switch that is on by default
    (`--artifact-weights false`); None leaves the option out; a list repeats the option's values.
    """
    switches = {
        name
        for model in (ServerSettings, ConnectionLimits, RayServeOptions, ReplicaOptions)
        for name, field in model.model_fields.items()
        if (field.json_schema_extra or {}).get("switch")
    }
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-").lstrip("-")
        if value is True:
            argv.append(flag)
        elif value is False and key in switches:
            argv += [flag, "false"]
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def ray_warnings(args: argparse.Namespace, settings: ServerSettings) -> list[str]:
    """What `dicache serve --ray` warns about at start: a reachable address without an API key (as the single-process
    server does), and connection options that only the single-process server (uvicorn) applies."""
    from ..server.runner import exposure_warnings  # the serve extra: the runner imports uvicorn

    warnings = exposure_warnings(args.host, settings)
    given, default = limits_from_args(args), ConnectionLimits()
    ignored = [
        ConnectionLimits.model_fields[name].json_schema_extra["flag"]
        for name in ("max_connections", "keep_alive_s", "header_timeout_s")
        if getattr(given, name) != getattr(default, name)
    ]
    if ignored:
        warnings.append(
            f"{', '.join(ignored)}: ignored with --ray (Ray Serve's proxy holds the connections, with its own limits); "
            "the request limits, --max-body-bytes and --body-timeout apply"
        )
    return warnings


def run_ray(args: argparse.Namespace) -> int:
    try:  # the ray extra: the driver imports Ray and Serve
        from ..server.ray.driver import serve_on_ray
    except ModuleNotFoundError as exc:
        raise DicacheError(f"dicache serve --ray needs the ray extra: pip install 'dicache[ray]' ({exc})") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cache_config = read_cache_config(args.profile)
    print(cache_config.describe(), flush=True)
    profile = describe_profile(cache_config)
    if profile:
        print(profile, flush=True)
    spec = replica_spec_from_args(args, cache_config)
    serve_options_from_args(args, spec, cluster_gpus=0)  # the degrees and the options, before any warning
    for warning in ray_warnings(args, spec.settings):
        logging.getLogger("dicache.server").warning(warning)
    return serve_on_ray(spec, values_from_args(args, RayServeOptions), args.host, args.port, args.ray_address)
