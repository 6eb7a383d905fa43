"""The `dicache serve` options shared by the single-process server and `--ray`: the options of the server and its
model (`add_server_arguments`; the Ray group is `serve_ray.add_ray_arguments`) and the declared models built from the
parsed options (`settings_from_args`, `limits_from_args`)."""

from __future__ import annotations

import argparse

from ..parallel import add_parallel_arguments
from ..server.settings import ConnectionLimits, ServerSettings, parse_default_size, server_settings
from ..settings.profiles import add_profile_argument
from . import argtypes
from .fields import add_options, values_from_args
from .memory import add_offload_arguments
from .speed import add_speed_arguments


def _size(text: str) -> tuple[int, int]:
    try:
        return parse_default_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Every `dicache serve` option but the Ray group: the model, its loading, parallelism and memory options, the
    address, the server's limits (`ServerSettings`) and the connection options."""
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or hub id (default: the embedded checkpoint; its Turbo student with --variant turbo)",
    )
    add_profile_argument(parser)
    add_parallel_arguments(parser)
    add_speed_arguments(parser)
    add_offload_arguments(parser)
    parser.add_argument(
        "--variant",
        choices=("turbo", "raw"),
        default=None,
        help="preset for requests that leave steps / guidance out: turbo = 8 steps, guidance 1.0 "
        "(no CFG); raw = 50 steps, guidance 4.5 (default: the checkpoint's own, turbo if distilled)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1; another address without an API key logs a warning)",
    )
    parser.add_argument("--port", type=argtypes.port, default=30000, help="port, 1..65535 (default: 30000)")
    parser.add_argument("--dtype", default=None, help="weights dtype, e.g. bfloat16 (default: the pipeline's)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument(
        "--torch-threads", type=argtypes.integer(1), default=None, help="CPU threads per torch op (default: torch's)"
    )
    parser.add_argument("--default-size", type=_size, default=None, help="size when a request omits it (WxH)")
    add_options(parser, ServerSettings)  # --model-id, --max-queue, --workers, --timeout, --max-n, --max-side ...
    add_network_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """The API key and the connection limits (the other exposure and drain options are `ServerSettings` fields)."""
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise); prefer the DICACHE_API_KEY environment "
        "variable, which other users cannot read from the process list (default: DICACHE_API_KEY, else none)",
    )
    add_options(parser, ConnectionLimits)


def limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(**values_from_args(args, ConnectionLimits))


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """`ServerSettings` from the options (`server_settings`: `max_pixels` is `--max-side` squared, the key
    `--api-key` else DICACHE_API_KEY)."""
    return server_settings(values_from_args(args, ServerSettings), args.api_key)
