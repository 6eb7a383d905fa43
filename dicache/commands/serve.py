"""`dicache serve`: the OpenAI-compatible image server (FastAPI + uvicorn) with SGLANG_CACHE_DIT_* caching over an
optional settings profile (`--profile PATH` or SGLANG_CACHE_DIT_PROFILE), applied to every request."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch

from ..errors import ConfigError, DicacheError
from ..models import prefetch
from ..offload.settings import OffloadLimits
from ..parallel import lockstep, parallelize_pipeline, setup_from_args
from ..settings.profiles import cache_config as read_cache_config
from ..settings.profiles import describe_profile
from .memory import describe, offload_settings
from .serve_args import add_server_arguments, limits_from_args, settings_from_args
from .serve_ray import add_ray_arguments, run_ray
from .speed import apply_speed_options, compile_artifact_store, speed_spec, text_encoder_quantization, weight_store

HELP = (
    "serve Krea-2 over an OpenAI-compatible HTTP API (POST /v1/images/generations, GET /v1/models, /health, "
    "/health_generate, /metrics); cache settings from SGLANG_CACHE_DIT_* (over --profile) at start-up, overridable "
    "per request; API key from DICACHE_API_KEY; SIGTERM drains"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    add_ray_arguments(parser)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"dicache serve: {message}")


def parse_serve_argv(argv: list[str]) -> argparse.Namespace:
    """`dicache serve` options (as for the command line) -> the parsed namespace; a bad one raises ConfigError."""
    parser = _RaisingParser(prog="dicache serve", add_help=False, allow_abbrev=False)
    add_arguments(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.ray:
        return run_ray(args)
    try:  # the serve extra (fastapi, uvicorn); runner.serve is read here, when called (tests swap it)
        from ..server import create_app
        from ..server.runner import ensure_descriptors, exposure_warnings, serve
        from ..server.startup import StartupTimeline
    except ModuleNotFoundError as exc:
        raise DicacheError(f"dicache serve needs the serve extra: pip install 'dicache[serve]' ({exc})") from None
    timeline = StartupTimeline()
    timeline.imports_done(prefetch.ENTERED)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    if args.default_size is not None:  # requests without a size get it: it obeys --max-side too
        from ..server.generation import check_default_size  # the serve extra: server.generation reads requests

        check_default_size(*args.default_size, settings)
    limits = limits_from_args(args)
    ensure_descriptors(limits.max_connections)  # before the model loads: a bad limit fails fast
    for warning in exposure_warnings(args.host, settings):
        logging.getLogger("dicache.server").warning(warning)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    # defaults < profile (--profile wins over SGLANG_CACHE_DIT_PROFILE) < SGLANG_CACHE_DIT_*; a bad value or a
    # missing profile stops here, naming the variable or the option and path
    cache_config = read_cache_config(args.profile)
    speed_spec(args)  # a bad --quantization-exclude stops here, before loading
    print(cache_config.describe(), flush=True)
    profile = describe_profile(cache_config)
    if profile:
        print(profile, flush=True)
    ctx = setup_from_args(args)  # single process unless launched with torchrun and --tp-size / --ulysses-degree
    backend = start_backend(args, ctx, cache_config, settings.workers, timeline)
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


def read_rates(reads: dict) -> dict:
    """Each component read from files: seconds, GB and GB/s (what `/v1/server_info` "startup" "reads" shows)."""
    return {
        name: {
            "seconds": read["seconds"],
            "GB": round(read["bytes"] / 1e9, 3),
            "GBps": round(read["bytes"] / 1e9 / read["seconds"], 3) if read["seconds"] > 0 else None,
        }
        for name, read in reads.items()
    }


def start_backend(args: argparse.Namespace, ctx: Any, cache_config: Any, workers: int, timeline: Any) -> Any:
    """Everything `dicache serve` does before it listens, on every rank: load (quantising while reading, unless the
    model is split over processes: then after the split), split, compile, warm up from the compile artifact
    (`--compile-artifact`), prepare the prompt lengths; the phases go to `timeline` (`server.startup`)."""
    from ..server import load_backend  # the serve extra (fastapi), imported by `run` before this is called
    from ..server.backend import ready_to_serve

    offload = offload_settings(args, parallel=ctx.enabled, workers=workers)
    offload_limits = OffloadLimits(  # the plan covers the largest request the server accepts
        max_height=args.max_side,
        max_width=args.max_side,
        max_images=args.max_n,
        cfg=True,
        size_source=" (--max-side, --max-n)",
    )
    at_load = offload.any or not ctx.enabled  # a split model is quantised after the split: each shard its scales
    timeline.watch(ctx.device)
    # with offload, loading quantizes, plans and places, then compiles, in that order
    backend = load_backend(
        args.model,
        args.variant,
        dtype=args.dtype,
        device=str(ctx.device),
        cache_config=cache_config,
        default_size=args.default_size,
        load_format=args.load_format,
        offload=offload,
        offload_limits=offload_limits,
        quantization=speed_spec(args) if at_load else None,
        text_encoder_quantization=text_encoder_quantization(args) if at_load else None,
        compile=args.compile and offload.any,
        weight_store=weight_store(args, at_load and not offload.any),
    )
    for name, seconds in getattr(backend.pipe, "load_timings", {}).items():
        timeline.add(name, seconds)
    timeline.details["reads"] = read_rates(getattr(backend.pipe, "load_reads", {}))
    if getattr(backend.pipe, "weight_snapshots", None):
        timeline.details["weight_snapshots"] = backend.pipe.weight_snapshots
    if prefetch.current() is not None:  # where the reading in the background stood when loading ended
        timeline.details["prefetch"] = prefetch.current().report()
    if describe(backend.pipe):
        print(describe(backend.pipe), flush=True)
    parallelize_pipeline(backend.pipe, ctx)
    if not offload.any:
        with timeline.phase("speed"):
            apply_speed_options(backend.pipe, args)
    # every rank warms up the same way; then memory released and start-up objects frozen, as in each Ray replica
    ready_to_serve(
        backend,
        warm_up=args.compile,
        prepare_text_lengths=args.prepare_text_lengths,
        report=lambda line: print(line, flush=True),
        compile_artifact=compile_artifact_store(args),
        timeline=timeline,
    )
    return backend
