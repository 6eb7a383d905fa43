"""The `dicache serve` options shared by the single-process server and `--ray`: the options of the server and its
model (`add_server_arguments`; the Ray group is `serve_ray.add_ray_arguments`) and the declared models built from the
parsed options (`settings_from_args`, `limits_from_args`)."""

from __future__ import annotations

import argparse

from ..models.options import DeviceOptions, ModelChoice
from ..offload.settings import OffloadSettings
from ..server.settings import (
    ConnectionLimits,
    ListenOptions,
    ServerProcessOptions,
    ServerSettings,
    server_settings,
)
from .fields import add_options, values_from_args
from .memory import add_offload_arguments
from .shared import add_parallel_arguments, add_profile_argument
from .speed import add_speed_arguments


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Every `dicache serve` option but the Ray group, from their declarations: the model (`ModelChoice`), its
    device and precision, settings profile, parallelism, loading, speed and memory options, the server process
    (`ServerProcessOptions`), the server's limits (`ServerSettings`), the connection limits and where it listens."""
    add_options(parser, ModelChoice)
    add_options(parser, DeviceOptions)
    add_profile_argument(parser)
    add_parallel_arguments(parser)
    add_speed_arguments(parser)
    add_offload_arguments(parser)
    add_options(parser, ServerProcessOptions)
    add_options(parser, ServerSettings)  # --model-id, --max-queue, --workers, --timeout, --max-n, --max-side ...
    add_options(parser, ConnectionLimits)
    add_options(parser, ListenOptions)


def limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(**values_from_args(args, ConnectionLimits))


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """`ServerSettings` from the options (`server_settings`: the key `--api-key` else DICACHE_API_KEY); `--workers`
    left out: 2, or 1 when the memory options ask for offload (an offloaded pipeline runs one generation at a
    time)."""
    values = values_from_args(args, ServerSettings)
    if values["workers"] is None:
        offloaded = OffloadSettings(**values_from_args(args, OffloadSettings)).any
        values["workers"] = 1 if offloaded else ServerSettings.model_fields["workers"].default
    return server_settings(values, args.api_key)
