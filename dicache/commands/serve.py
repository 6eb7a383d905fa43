"""`dicache serve`: the OpenAI-compatible image server (FastAPI + uvicorn) with SGLANG_CACHE_DIT_* caching over an
optional settings profile (`--profile PATH` or SGLANG_CACHE_DIT_PROFILE), applied to every request."""

from __future__ import annotations

import argparse

from . import argtypes

HELP = (
    "serve Krea-2 over an OpenAI-compatible HTTP API (POST /v1/images/generations, GET /v1/models, /health, "
    "/health_generate, /metrics); cache settings from SGLANG_CACHE_DIT_* (over --profile) at start-up, overridable "
    "per request; API key from DICACHE_API_KEY; SIGTERM drains"
)


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 1024x1024, got {text!r}") from None
    if width < 16 or height < 16 or width % 16 or height % 16:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: each side must be a multiple of 16, at least 16")
    return width, height


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..server.settings import ServerSettings
    from .fields import add_options

    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or hub id (default: the embedded checkpoint; its Turbo student with --variant turbo)",
    )
    from ..settings.profiles import add_profile_argument

    add_profile_argument(parser)
    from ..parallel import add_parallel_arguments

    add_parallel_arguments(parser)
    from .speed import add_speed_arguments

    add_speed_arguments(parser)
    from ..offload.cli import add_offload_arguments

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
    from .serve_ray import add_ray_arguments

    add_ray_arguments(parser)


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """The API key and the connection limits (the other exposure and drain options are `ServerSettings` fields)."""
    from ..server.settings import ConnectionLimits
    from .fields import add_options

    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise); prefer the DICACHE_API_KEY environment "
        "variable, which other users cannot read from the process list (default: DICACHE_API_KEY, else none)",
    )
    add_options(parser, ConnectionLimits)


def limits_from_args(args: argparse.Namespace):
    from ..server.settings import ConnectionLimits
    from .fields import values_from_args

    return ConnectionLimits(**values_from_args(args, ConnectionLimits))


def settings_from_args(args: argparse.Namespace):
    """`ServerSettings` from the options; `max_pixels` is `--max-side` squared, the key `--api-key` else
    DICACHE_API_KEY."""
    import os

    from ..errors import ConfigError
    from ..server.auth import API_KEY_ENV
    from ..server.settings import ServerSettings
    from .fields import values_from_args

    if args.api_key is not None and not args.api_key.strip():  # e.g. --api-key "$KEY" with KEY unset
        raise ConfigError("serve: --api-key is empty: give a key, or leave the option out (no authentication)")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.metrics_auth and not api_key:
        raise ConfigError(f"serve: --metrics-auth needs an API key (--api-key or {API_KEY_ENV})")
    try:
        return ServerSettings(
            **values_from_args(args, ServerSettings), max_pixels=args.max_side * args.max_side, api_key=api_key
        )
    except ValueError as exc:
        raise ConfigError(f"serve: {exc}") from None


def run(args: argparse.Namespace) -> int:
    if args.ray:
        from .serve_ray import run_ray

        return run_ray(args)
    import logging

    from ..errors import DicacheError

    try:
        from ..server import create_app, load_backend
        from ..server.runner import ensure_descriptors, exposure_warnings, serve
    except ModuleNotFoundError as exc:
        raise DicacheError(f"dicache serve needs the serve extra: pip install 'dicache[serve]' ({exc})") from None
    from ..settings.profiles import cache_config as read_cache_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    if args.default_size is not None:  # requests without a size get it: it obeys --max-side too
        from ..server.generation import check_default_size

        check_default_size(*args.default_size, settings)
    limits = limits_from_args(args)
    ensure_descriptors(limits.max_connections)  # before the model loads: a bad limit fails fast
    for warning in exposure_warnings(args.host, settings):
        logging.getLogger("dicache.server").warning(warning)
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    # defaults < profile (--profile wins over SGLANG_CACHE_DIT_PROFILE) < SGLANG_CACHE_DIT_*; a bad value or a
    # missing profile stops here, naming the variable or the option and path
    cache_config = read_cache_config(args.profile)
    from .speed import apply_speed_options, speed_spec

    speed_spec(args)  # a bad --quantization-exclude stops here, before loading
    print(cache_config.describe(), flush=True)
    from ..settings.profiles import describe_profile

    profile = describe_profile(cache_config)
    if profile:
        print(profile, flush=True)
    from ..parallel import lockstep, parallelize_pipeline, setup_from_args

    ctx = setup_from_args(args)  # single process unless launched with torchrun and --tp-size / --ulysses-degree
    from ..offload.cli import describe, offload_options

    offload = offload_options(  # the plan covers the largest request the server accepts
        args,
        max_height=args.max_side,
        max_width=args.max_side,
        max_images=args.max_n,
        cfg=True,
        size_source=" (--max-side, --max-n)",
        parallel=ctx.enabled,
        cache_config=cache_config,
        workers=args.workers,
    )
    # with offload, loading quantizes, plans and places, then compiles, in that order
    speed = dict(quantization=speed_spec(args), compile=args.compile) if offload else {}
    backend = load_backend(
        args.model,
        args.variant,
        dtype=args.dtype,
        device=str(ctx.device),
        cache_config=cache_config,
        default_size=args.default_size,
        load_format=args.load_format,
        offload={**offload, **speed},
    )
    if describe(backend.pipe):
        print(describe(backend.pipe), flush=True)
    parallelize_pipeline(backend.pipe, ctx)
    if not offload:
        apply_speed_options(backend.pipe, args)
    if args.compile:  # every rank warms up the same way, before serving, so the first request is not the slow one
        print(f"warm-up (compile): {backend.warm_up()}", flush=True)
    backend = lockstep(backend, ctx)
    if backend is None:  # a follower rank: it replayed rank 0's requests until rank 0 closed
        ctx.shutdown()
        return 0
    try:
        app = create_app(backend, settings)
        serve(app, args.host, args.port, limits, args.log_level)  # returns after SIGTERM and the drain
    finally:
        backend.close()
        ctx.shutdown()
    return 0
