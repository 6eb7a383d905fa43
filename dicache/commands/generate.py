"""`dicache generate`: text-to-image with Krea-2, caching configured from SGLANG_CACHE_DIT_* variables over an
optional settings profile (`--profile PATH` or SGLANG_CACHE_DIT_PROFILE, e.g. written by `dicache calibrate`)."""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from .. import api
from ..models.krea2.checkpoints import resolve_model
from ..models.krea2.pipeline import Krea2Pipeline
from ..offload.settings import OffloadLimits
from ..parallel import add_parallel_arguments, parallelize_pipeline, setup_from_args
from ..settings.profiles import add_profile_argument, cache_config, describe_profile, profile_source
from .memory import add_offload_arguments, cfg_of, describe, offload_settings
from .speed import add_speed_arguments, apply_speed_options, speed_spec

HELP = "generate images with Krea-2 (default: the embedded checkpoint) and print the cache statistics"


def add_sampling_arguments(parser: argparse.ArgumentParser, *variant_aliases: str) -> None:
    """`--model`, `--variant` (plus `variant_aliases`), `--steps`, `--guidance`: what to sample with, shared by the
    commands that run the pipeline (`generate`, `calibrate`)."""
    parser.add_argument(
        "--model",
        default=None,
        help="local diffusers-layout folder or hub repo id (default: the embedded checkpoint; with --variant turbo "
        "its distilled Turbo student)",
    )
    parser.add_argument(
        "--variant",
        *variant_aliases,
        choices=("turbo", "raw"),
        default=None,
        help="turbo: 8 steps, no CFG; raw: 50 steps, CFG 4.5 (default: by checkpoint)",
    )
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: by variant)")
    parser.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="CFG scale s in uncond + s*(cond - uncond); 1 = no CFG (Krea's reference g = s - 1)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="one or more prompts")
    add_sampling_arguments(parser)
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--num-images", type=int, default=1, help="images per prompt")
    parser.add_argument("--out", default="dicache.png", help="output PNG (several images: name-<i>.png)")
    parser.add_argument(
        "--cache",
        choices=("env", "on", "off"),
        default="env",
        help="env: SGLANG_CACHE_DIT_ENABLED (or the profile's enable_cache) decides (default); on/off force it",
    )
    add_profile_argument(parser)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument(
        "--stats-json",
        default=None,
        help="also write the cache statistics as JSON here (with the settings used and where each came from)",
    )
    add_parallel_arguments(parser)
    add_speed_arguments(parser)
    add_offload_arguments(parser)


def output_paths(out: str, count: int) -> list[pathlib.Path]:
    path = pathlib.Path(out)
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix or '.png'}") for i in range(count)]


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
    )
    # with offload, loading quantizes, plans and places, then compiles, in that order
    speed = dict(quantization=speed_spec(args), compile=args.compile) if offload.any else {}
    pipe = Krea2Pipeline.from_pretrained(
        resolve_model(args.model, args.variant),
        device=ctx.device,
        load_format=args.load_format,
        offload_settings=offload,
        offload_limits=limits,
        cache_config=config,
        **speed,
    )
    if describe(pipe):
        print(describe(pipe))
    parallelize_pipeline(pipe, ctx)
    if not offload.any:
        apply_speed_options(pipe, args)
    if use_cache:
        api.enable(pipe, config)
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
