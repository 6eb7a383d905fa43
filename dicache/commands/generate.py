"""`dicache generate`: text-to-image with Krea-2, caching configured from SGLANG_CACHE_DIT_* variables over an
optional settings profile (`--profile PATH` or SGLANG_CACHE_DIT_PROFILE, e.g. written by `dicache calibrate`).

An image whose latents or pixels hold NaN or inf is not written (and a file already at its path is removed); the
other images of the command are, and the command then exits 1 with a message naming what was not written."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Literal

import numpy as np
import torch

from .. import api
from ..errors import ConfigError, NonFiniteOutputError
from ..models.compile_artifact import load_artifact, save_artifact
from ..models.families import call_kwargs, call_parameters, is_family_model, load_family_model, pipeline_class
from ..models.krea2.checkpoints import resolve_model
from ..models.krea2.latents import FINITE_PLACES, check_finite, finite_per_image, pil_images
from ..models.krea2.pipeline import Krea2Pipeline
from ..models.options import DeviceOptions, ModelChoice, SamplingOptions
from ..offload.settings import OffloadLimits
from ..parallel import parallelize_pipeline, setup_from_args
from ..settings.devices import resolve_device
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
    weight_store,
)

VIDEO_FPS = 16.0
"""Frames per second of a video written by `generate` unless its checkpoint's dicache.json says `fps`."""
HELP = (
    "generate images with Krea-2 (default: the embedded checkpoint) or a diffusers pipeline of a registered family "
    "(--model), and print the cache statistics"
)


def image_file(path: str) -> str:
    """`path` when its suffix names an image format Pillow writes, else a `ValueError` listing them (checked while
    parsing, so that nothing generated is lost at the end)."""
    allowed = image_suffixes()
    if pathlib.Path(path).suffix.lower() not in allowed:
        raise ValueError(
            f"--out={path!r} is invalid: name an image file whose suffix Pillow writes: {', '.join(allowed)}"
        )
    return path


def image_suffixes() -> list[str]:
    """File suffixes Pillow can write (lower case, sorted), e.g. `.png`, `.jpg`, `.webp`."""
    from PIL import Image  # Pillow loads its plugins on first use: only a parsed --out needs them

    Image.init()
    return sorted(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.SAVE)


class GenerateOptions(FlagOptions):
    """What `dicache generate` makes and where it writes it (the model, sampling, device, memory and speed options
    are the shared declarations: `add_arguments`)."""

    prompt: list[str] = option(..., flag="prompt", help="one or more prompts")
    negative_prompt: str | None = option(None, flag="--negative-prompt", help="what the images should not show (CFG)")
    seed: int = option(0, flag="--seed", ge=0, help="seed of the initial noise (one generator for every image)")
    height: int | None = option(None, flag="--height", ge=1, default_text="the checkpoint's", help="image height, px")
    width: int | None = option(None, flag="--width", ge=1, default_text="the checkpoint's", help="image width, px")
    num_images: int = option(1, flag="--num-images", ge=1, help="images per prompt")
    out: str = option(
        "dicache.png",
        flag="--out",
        read=image_file,
        help="output image, its format by suffix (several images: name-<i>.png)",
    )
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


def write_finite_images(
    latents: torch.Tensor | None, images: torch.Tensor, paths: list[pathlib.Path]
) -> NonFiniteOutputError | None:
    """Write each image (a pipeline's "pt" output, `(B, 3, H, W)` in [0, 1]) whose latents (when given) and pixels
    are all finite to its path as the pipeline's "pil" output would be; an image with NaN or inf is not written (nor
    an earlier file at its path left in place). Returns the `NonFiniteOutputError` naming those, or None."""
    checked, places = ((latents, images), FINITE_PLACES) if latents is not None else ((images,), FINITE_PLACES[1:])
    try:
        check_finite(finite_per_image(*checked), places)
        failure = None
    except NonFiniteOutputError as exc:
        failure = exc
    spoiled = failure.images if failure is not None else {}
    for index, path in enumerate(paths):
        if index in spoiled:
            path.unlink(missing_ok=True)  # an older image there would pass for this one
            continue
        (image,) = pil_images(images[index : index + 1].permute(0, 2, 3, 1).cpu().numpy())
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path)
    return failure


def write_finite_videos(frames: torch.Tensor, paths: list[pathlib.Path], fps: float) -> NonFiniteOutputError | None:
    """Write each video of `frames` (`(B, F, H, W, 3)` floats in [0, 1], a video pipeline's "np" output) whose
    frames are all finite to its path as an animated image at `fps` frames per second (the format Pillow reads from
    the suffix: animated PNG for `.png`, also `.gif`, `.webp`); a video with NaN or inf is not written (nor an earlier
    file at its path left in place). Returns the `NonFiniteOutputError` naming those, or None."""
    try:
        check_finite(finite_per_image(frames), ("decoded frames",))
        failure = None
    except NonFiniteOutputError as exc:
        failure = exc
    for index, path in enumerate(paths):
        if failure is not None and index in failure.images:
            path.unlink(missing_ok=True)
            continue
        first, *rest = pil_images(frames[index].cpu().numpy())
        path.parent.mkdir(parents=True, exist_ok=True)
        first.save(path, save_all=True, append_images=rest, duration=round(1000 / fps), loop=0)
    return failure


def write_and_say(
    latents: torch.Tensor | None,
    images: torch.Tensor,
    paths: list[pathlib.Path],
    what: str,
    video_fps: float | None = None,
) -> bool:
    """`write_finite_images` (or, with `video_fps`, `write_finite_videos` of `images` as `(B, F, H, W, 3)`), then
    "wrote <paths> <what>" for those written and, on stderr, the error naming those that were not. Returns whether
    every one was written."""
    if video_fps is None:
        failure = write_finite_images(latents, images, paths)
    else:
        failure = write_finite_videos(images, paths, video_fps)
    written = [str(p) for i, p in enumerate(paths) if failure is None or i not in failure.images]
    if written:
        print(f"wrote {', '.join(written)} {what}")
    if failure is not None:
        skipped = ", ".join(str(paths[i]) for i in sorted(failure.images))
        print(f"error: {failure}; not written: {skipped}", file=sys.stderr)
    return failure is None


def run(args: argparse.Namespace) -> int:
    config = cache_config(args.profile)  # defaults < profile (--profile wins over the variable) < environment
    speed_spec(args)  # a bad --quantization-exclude stops here, before loading
    use_cache = config.enable_cache if args.cache == "env" else args.cache == "on"
    args.device = str(resolve_device(args.device))  # a device this machine lacks stops here, before loading
    if is_family_model(args.model):
        return _generate_family(args, config, use_cache)
    ctx = setup_from_args(args)  # single process unless launched with torchrun and --tp-size / --ulysses-degree
    try:
        return _generate(args, ctx, config, use_cache)
    finally:
        ctx.shutdown()


KREA2_ONLY = {
    "variant": None,
    "tp_size": 1,
    "ulysses_degree": 1,
    "quantization": "none",
    "quantization_exclude": None,
    "compile": False,
    "compile_artifact": None,
    "load_format": "auto",
    "text_encoder_quantization": "none",
}
"""Options only the native Krea-2 pipeline takes, with their defaults (a family's pipeline refuses other values)."""


def refuse_krea2_options(args: argparse.Namespace, name: str) -> None:
    """A `ConfigError` naming the first option set that a family's pipeline (`name`) cannot take."""
    for key, default in KREA2_ONLY.items():
        if getattr(args, key, default) != default:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{flag}={getattr(args, key)!r} is refused for {name}: only Krea-2 takes it")
    if offload_settings(args, parallel=False).any:
        raise ConfigError(f"the memory options (--dit-layerwise-offload, ...) are refused for {name}: Krea-2 only")


def _generate_family(args: argparse.Namespace, config, use_cache: bool) -> int:
    """`generate` on a diffusers pipeline of a registered family: its own `__call__`, the same statistics."""
    name = f"{pipeline_class(args.model)} ({args.model})"
    refuse_krea2_options(args, name)
    dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
    model = load_family_model(args.model, dtype=dtype, device=args.device)
    sampling = model.sampling
    steps = args.steps or sampling["steps"]
    guidance = args.guidance if args.guidance is not None else sampling["guidance"]
    height, width = model.default_size
    kwargs = call_kwargs(
        model,
        steps=steps,
        guidance=guidance,
        embedded_guidance=getattr(args, "embedded_guidance", None),
        height=args.height or height,
        width=args.width or width,
        seed=args.seed,
    )
    if args.negative_prompt is not None:
        kwargs["negative_prompt"] = args.negative_prompt
    pipe = model.pipe
    video = not hasattr(pipe, "image_processor")  # a video pipeline has a video processor instead
    count = next((p for p in ("num_images_per_prompt", "num_videos_per_prompt") if p in call_parameters(pipe)), None)
    if count is not None:
        kwargs[count] = args.num_images
    elif args.num_images != 1:
        raise ConfigError(
            f"--num-images={args.num_images} is refused for {model.name}: its pipeline makes one output per prompt"
        )
    if use_cache:
        api.enable(pipe, config)
    start = time.perf_counter()
    with torch.no_grad():
        out = pipe(list(args.prompt), output_type="np" if video else "pt", **kwargs)
    seconds = time.perf_counter() - start
    what = f"in {seconds:.2f} s (model: {model.name} from {args.model}; {steps} steps, guidance {guidance:g})"
    if video:  # "np": (B, F, H, W, 3) in [0, 1], each video written as an animated image
        frames = torch.as_tensor(np.asarray(out.frames, dtype=np.float32))
        fps = float(model.extras.get("fps", VIDEO_FPS))
        if not write_and_say(None, frames, output_paths(args.out, len(frames)), what, video_fps=fps):
            return 1
        return _report(args, config, use_cache, pipe)
    paths = output_paths(args.out, len(out.images))
    if not write_and_say(None, out.images.float(), paths, what):  # "pt": (B, 3, H, W) in [0, 1]
        return 1
    return _report(args, config, use_cache, pipe)


def _report(args: argparse.Namespace, config, use_cache: bool, pipe) -> int:
    """Print the cache statistics (and write them with `--stats-json`)."""
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


def _generate(args: argparse.Namespace, ctx, config, use_cache: bool) -> int:
    embedded = getattr(args, "embedded_guidance", None)  # absent from a namespace built without SamplingOptions
    if embedded is not None:
        raise ConfigError(f"--embedded-guidance={embedded:g} is refused for Krea-2: it has none")
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
        weight_store=weight_store(args, at_load and not offload.any),
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
        output_type="pt" if ctx.is_output_rank else "latent",
    )
    seconds = time.perf_counter() - start
    if key is not None and loaded.status != "loaded":
        save_artifact(store, key, {"generate_s": round(seconds, 2)})
    if not ctx.is_output_rank:
        return 0
    paths = output_paths(args.out, len(out.images))
    if not write_and_say(out.latents, out.images, paths, f"in {seconds:.2f} s (model: {pipe.source})"):
        return 1
    return _report(args, config, use_cache, pipe)
