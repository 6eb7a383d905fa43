"""`dicache generate`: text-to-image with Krea-2, caching configured from SGLANG_CACHE_DIT_* variables over an
optional settings profile (`--profile PATH` or SGLANG_CACHE_DIT_PROFILE, e.g. written by `dicache calibrate`)."""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from typing import Literal

import torch

from .. import api
from ..errors import ConfigError
from ..models.compile_artifact import load_artifact, save_artifact
from ..models.krea2.checkpoints import resolve_model
from ..models.krea2.pipeline import Krea2Pipeline
from ..models.options import DeviceOptions, ModelChoice, SamplingOptions
from ..offload.settings import OffloadLimits
from ..parallel import parallelize_pipeline, setup_from_args
from ..settings.options import FlagOptions, option
from ..settings.profiles import cache_config, describe_profile, profile_source
from .fields import add_options
from .memory import add_offload_arguments, cfg_of, describe, offload_settings
from .shared import add_parallel_arguments, add_profile_argument
from .speed import (
    add_speed_arguments,
    apply_speed_options,
    compile_artifact_store,
    speed_spec,
    text_encoder_quantization,
)

HELP = "generate images with Krea-2 (default: the embedded checkpoint) and print the cache statistics"


class GenerateOptions(FlagOptions):
    """What `dicache generate` makes and where it writes it (the model, sampling, device, memory and speed options
    are the shared declarations: `add_arguments`)."""

    prompt: list[str] = option(..., flag="prompt", help="one or more prompts")
    negative_prompt: str | None = option(None, flag="--negative-prompt", help="what the images should not show (CFG)")
    seed: int = option(0, flag="--seed", ge=0, help="seed of the initial noise (one generator for every image)")
    height: int | None = option(None, flag="--height", ge=1, default_text="the checkpoint's", help="image height, px")
    width: int | None = option(None, flag="--width", ge=1, default_text="the checkpoint's", help="image width, px")
    num_images: int = option(1, flag="--num-images", ge=1, help="images per prompt")
    out: str = option("dicache.png", flag="--out", help="output PNG (several images: name-<i>.png)")
    cache: Literal["env", "on", "off"] = option(
        "env",
        flag="--cache",
        help="env: SGLANG_CACHE_DIT_ENABLED (or the profile's enable_cache) decides; on/off force it",
    )
    stats_json: str | None = option(
        None,
        flag="--stats-json",
        metavar="PATH",
        help="also write the cache statistics as JSON here (with the settings used and where each came from)",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, *variant_aliases: str) -> None:
    """`--model`, `--variant` (plus `variant_aliases`), `--steps`, `--guidance`: what to sample with, shared by the
    commands that run the pipeline (`generate`, `calibrate`); a bad value is a usage error naming the option."""
    add_options(parser, ModelChoice, aliases={"variant": variant_aliases})
    add_options(parser, SamplingOptions)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, GenerateOptions)
    add_sampling_arguments(parser)
    add_options(parser, DeviceOptions, only=("device",))
    add_profile_argument(parser)
    add_parallel_arguments(parser)
    add_speed_arguments(parser)
    add_offload_arguments(parser)


def output_paths(out: str, count: int) -> list[pathlib.Path]:
    path = pathlib.Path(out)
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix or '.png'}") for i in range(count)]


def check_size(pipe: Krea2Pipeline, args: argparse.Namespace) -> None:
    """`--height` / `--width` against the loaded checkpoint's size multiple (a `ConfigError` naming the option)."""
    multiple = pipe.size_multiple
    for flag, value in (("--height", args.height), ("--width", args.width)):
        if value is not None and value % multiple:
            raise ConfigError(f"{flag}={value} is invalid: must be a multiple of {multiple} px for {pipe.source}")


def request_shapes(pipe: Krea2Pipeline, args: argparse.Namespace, ctx, use_cache: bool) -> dict:
    """What this command's one call compiles for (the compile artifact's key, `Krea2Pipeline.compile_key`): the
    size (the checkpoint's default when not given), steps, guidance, variant, prompts, images per prompt, whether
    the cache is on (its hooks run between the compiled blocks) and the processes the model is split over."""
    height, width = pipe.default_size
    return {
        "size": [args.width or width, args.height or height],
        "steps": args.steps,
        "guidance": args.guidance,
        "variant": args.variant,
        "negative_prompt": args.negative_prompt is not None,
        "prompts": len(args.prompt),
        "images": args.num_images,
        "cache": use_cache,
        "ranks": ctx.world_size if ctx.enabled else 1,
    }


def run(args: argparse.Namespace) -> int:
    config = cache_config(args.profile)  # defaults < profile (--profile wins over the variable) < environment
    speed_spec(args)  # a bad --quantization-exclude stops here, before loading
    use_cache = config.enable_cache if args.cache == "env" else args.cache == "on"
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = setup_from_args(args)  # single process unless launched with torchrun and --tp-size / --ulysses-degree
    try:
        return _generate(args, ctx, config, use_cache)
    finally:
        ctx.shutdown()


def _generate(args: argparse.Namespace, ctx, config, use_cache: bool) -> int:
    offload = offload_settings(args, parallel=ctx.enabled)
    limits = OffloadLimits(  # the plan covers this command's request
        max_height=args.height,
        max_width=args.width,
        max_images=len(args.prompt) * args.num_images,
        cfg=cfg_of(args.guidance, args.variant),
        size_source=" (--height, --width, --num-images)",
    )
    at_load = offload.any or not ctx.enabled  # a split model is quantised after the split: each shard its scales
    # with offload, loading quantizes, plans and places, then compiles, in that order
    pipe = Krea2Pipeline.from_pretrained(
        resolve_model(args.model, args.variant),
        device=ctx.device,
        load_format=args.load_format,
        quantization=speed_spec(args) if at_load else None,
        text_encoder_quantization=text_encoder_quantization(args) if at_load else None,
        compile=args.compile and offload.any,
        offload_settings=offload,
        offload_limits=limits,
        cache_config=config,
    )
    check_size(pipe, args)
    if describe(pipe):
        print(describe(pipe))
    parallelize_pipeline(pipe, ctx)
    if not offload.any:
        apply_speed_options(pipe, args)
    if use_cache:
        api.enable(pipe, config)
    store = compile_artifact_store(args)
    key = pipe.compile_key(request_shapes(pipe, args, ctx, use_cache)) if store is not None else None
    loaded = load_artifact(store, key) if key is not None else None
    start = time.perf_counter()
    out = pipe(
        args.prompt,
        negative_prompt=args.negative_prompt,
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        seed=ctx.agree_seed(args.seed),
        num_images_per_prompt=args.num_images,
        variant=args.variant,
        output_type="pil" if ctx.is_output_rank else "latent",
    )
    seconds = time.perf_counter() - start
    if key is not None and loaded.status != "loaded":
        save_artifact(store, key, {"generate_s": round(seconds, 2)})
    if not ctx.is_output_rank:
        return 0
    paths = output_paths(args.out, len(out.images))
    for image, path in zip(out.images, paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path)
    print(f"wrote {', '.join(str(p) for p in paths)} in {seconds:.2f} s (model: {pipe.source})")
    if not use_cache:
        print("caching off (set SGLANG_CACHE_DIT_ENABLED=true or pass --cache on)")
        return 0

    profile = describe_profile(config)
    if profile:
        print(profile)
    stats = api.stats(pipe)
    print(stats.table())
    if args.stats_json:
        record = {
            **stats.to_dict(),
            "config": {"settings": config.model_dump(), "sources": config.sources(), "profile": profile_source(config)},
        }
        pathlib.Path(args.stats_json).write_text(json.dumps(record, indent=2))
    return 0
