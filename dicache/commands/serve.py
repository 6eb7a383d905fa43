"""`dicache serve`: the OpenAI-compatible image server (FastAPI + uvicorn) with SGLANG_CACHE_DIT_* caching over an
optional settings profile (`--profile PATH` or SGLANG_CACHE_DIT_PROFILE), applied to every request."""

from __future__ import annotations

import argparse

HELP = (
    "serve Krea-2 over an OpenAI-compatible HTTP API (POST /v1/images/generations, GET /v1/models, /health, "
    "/metrics); cache settings from SGLANG_CACHE_DIT_* (over --profile) at start-up, overridable per request"
)


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 1024x1024, got {text!r}") from None
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
    parser.add_argument(
        "--variant",
        choices=("turbo", "raw"),
        default=None,
        help="preset for requests that leave steps / guidance out: turbo = 8 steps, guidance 1.0 "
        "(no CFG); raw = 50 steps, guidance 4.5 (default: the checkpoint's own, turbo if distilled)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port (default: 30000)")
    parser.add_argument("--model-id", default=d.model_id, help=f"name listed by /v1/models (default: {d.model_id})")
    parser.add_argument("--dtype", default=None, help="weights dtype, e.g. bfloat16 (default: the pipeline's)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--torch-threads", type=int, default=None, help="CPU threads per torch op (default: torch's)")
    parser.add_argument("--default-size", type=_size, default=None, help="size when a request omits it (WxH)")
    parser.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help=f"generations run at once (default: {d.workers}; outputs do not depend on it)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        help=f"requests allowed to wait; more get 429 (default: {d.max_queue})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=d.request_timeout_s,
        help=f"seconds per request, waiting included; past it 504 (default: {d.request_timeout_s:g})",
    )
    parser.add_argument("--max-n", type=int, default=d.max_n, help=f"images per request (default: {d.max_n})")
    parser.add_argument("--max-side", type=int, default=d.max_side, help=f"largest image side (default: {d.max_side})")
    parser.add_argument("--max-steps", type=int, default=d.max_steps, help=f"most steps (default: {d.max_steps})")
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        default=d.max_prompt_chars,
        help=f"longest prompt (default: {d.max_prompt_chars})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help=f"largest request body (default: {d.max_body_bytes})",
    )
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def settings_from_args(args: argparse.Namespace):
    from ..errors import ConfigError
    from ..server.settings import ServerSettings

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
        )
    except ValueError as exc:
        raise ConfigError(f"serve: {exc}") from None


def run(args: argparse.Namespace) -> int:
    import logging

    from ..errors import DicacheError

    try:
        import uvicorn

        from ..server import create_app, load_backend
    except ModuleNotFoundError as exc:
        raise DicacheError(f"dicache serve needs the serve extra: pip install 'dicache[serve]' ({exc})") from None
    from ..profiles import cache_config as read_cache_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    # defaults < profile (--profile wins over SGLANG_CACHE_DIT_PROFILE) < SGLANG_CACHE_DIT_*; a bad value or a
    # missing profile stops here, naming the variable or the option and path
    cache_config = read_cache_config(args.profile)
    print(cache_config.describe(), flush=True)
    from ..profiles import describe_profile

    profile = describe_profile(cache_config)
    if profile:
        print(profile, flush=True)
    from ..parallel import lockstep, parallelize_pipeline, setup_from_args

    ctx = setup_from_args(args)  # single process unless launched with torchrun and --tp-size / --ulysses-degree
    backend = load_backend(
        args.model,
        args.variant,
        dtype=args.dtype,
        device=str(ctx.device),
        cache_config=cache_config,
        default_size=args.default_size,
    )
    parallelize_pipeline(backend.pipe, ctx)
    backend = lockstep(backend, ctx)
    if backend is None:  # a follower rank: it replayed rank 0's requests until rank 0 closed
        ctx.shutdown()
        return 0
    try:
        app = create_app(backend, settings)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        backend.close()
        ctx.shutdown()
    return 0
