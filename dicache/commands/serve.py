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

    d = ServerSettings()
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or hub id (default: the embedded checkpoint; its Turbo student with --variant turbo)",
    )
    from ..profiles import add_profile_argument

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
    parser.add_argument("--model-id", default=d.model_id, help=f"name listed by /v1/models (default: {d.model_id})")
    parser.add_argument("--dtype", default=None, help="weights dtype, e.g. bfloat16 (default: the pipeline's)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument(
        "--torch-threads", type=argtypes.integer(1), default=None, help="CPU threads per torch op (default: torch's)"
    )
    parser.add_argument("--default-size", type=_size, default=None, help="size when a request omits it (WxH)")
    parser.add_argument(
        "--workers",
        type=argtypes.integer(1),
        default=d.workers,
        help=f"generations run at once (default: {d.workers}; outputs do not depend on it)",
    )
    parser.add_argument(
        "--max-queue",
        type=argtypes.integer(0),
        default=d.max_queue,
        help=f"requests allowed to wait for a busy worker; more get 429; 0: take requests only when a worker is "
        f"free (default: {d.max_queue})",
    )
    parser.add_argument(
        "--timeout",
        type=argtypes.seconds(),
        default=d.request_timeout_s,
        help="seconds per request, waiting included; past it 504, and the generation stops at its next transformer "
        "or VAE block, so its worker is busy at most one block longer (one transformer call if the blocks are "
        "compiled); the longest single block is that of the largest allowed --max-side x --max-n request "
        f"(default: {d.request_timeout_s:g})",
    )
    parser.add_argument(
        "--max-n", type=argtypes.integer(1), default=d.max_n, help=f"images per request (default: {d.max_n})"
    )
    parser.add_argument(
        "--max-side",
        type=argtypes.integer(16),
        default=d.max_side,
        help=f"largest image side; the work of one step grows with (side^2 x n)^2 (default: {d.max_side})",
    )
    parser.add_argument(
        "--max-steps", type=argtypes.integer(1), default=d.max_steps, help=f"most steps (default: {d.max_steps})"
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=argtypes.integer(1),
        default=d.max_prompt_chars,
        help=f"longest prompt (default: {d.max_prompt_chars})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=argtypes.integer(1024),
        default=d.max_body_bytes,
        help=f"largest request body; larger: 413 (default: {d.max_body_bytes})",
    )
    add_network_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    from .serve_ray import add_ray_arguments

    add_ray_arguments(parser)


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """Authentication, exposure, connection limits and the drain."""
    from ..server.settings import ConnectionLimits, ServerSettings

    d, c = ServerSettings(), ConnectionLimits()
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise); prefer the DICACHE_API_KEY environment "
        "variable, which other users cannot read from the process list (default: DICACHE_API_KEY, else none)",
    )
    parser.add_argument("--metrics-auth", action="store_true", help="/metrics needs the API key too")
    parser.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (default: off)")
    parser.add_argument(
        "--drain-timeout",
        type=argtypes.seconds(0, allow_low=True),
        default=d.drain_grace_s,
        help="on SIGTERM: new requests get 503 + Retry-After, accepted generations get this many seconds to finish, "
        "the rest get 503, then the process exits 0; a second SIGTERM ends the wait at once. Give the orchestrator "
        f"a termination grace period of at least this plus 15 s (default: {d.drain_grace_s:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=argtypes.seconds(),
        default=d.body_timeout_s,
        help=f"seconds a request body may take to arrive; then 408 (default: {d.body_timeout_s:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=argtypes.integer(1),
        default=c.max_connections,
        help="open connections before new requests get 503; each is a file descriptor, and the soft descriptor limit "
        f"is raised to fit (default: {c.max_connections})",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=argtypes.seconds(),
        default=c.keep_alive_s,
        help=f"seconds an idle keep-alive connection stays open (default: {c.keep_alive_s:g})",
    )
    parser.add_argument(
        "--header-timeout",
        type=argtypes.seconds(),
        default=c.header_timeout_s,
        help=f"seconds a new connection may take to send its request head (default: {c.header_timeout_s:g})",
    )


def limits_from_args(args: argparse.Namespace):
    from ..server.settings import ConnectionLimits

    return ConnectionLimits(
        max_connections=args.max_connections,
        keep_alive_s=args.keep_alive_timeout,
        header_timeout_s=args.header_timeout,
    )


def settings_from_args(args: argparse.Namespace):
    import os

    from ..errors import ConfigError
    from ..server.auth import API_KEY_ENV
    from ..server.settings import ServerSettings

    if args.metrics_auth and not (args.api_key or os.environ.get(API_KEY_ENV)):
        raise ConfigError(f"serve: --metrics-auth needs an API key (--api-key or {API_KEY_ENV})")
    try:
        return ServerSettings(
            model_id=args.model_id,
            max_queue=args.max_queue,
            workers=args.workers,
            request_timeout_s=args.timeout,
            max_n=args.max_n,
            max_side=args.max_side,
            max_pixels=args.max_side * args.max_side,
            max_steps=args.max_steps,
            max_prompt_chars=args.max_prompt_chars,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            protect_metrics=args.metrics_auth,
            docs=args.docs,
            drain_grace_s=args.drain_timeout,
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
    from ..profiles import cache_config as read_cache_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
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
    from ..profiles import describe_profile

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
