"""`dicache warmup`: make the compile artifact a server will load (docs/startup.md). It takes `dicache serve`'s
options and starts the model exactly as `dicache serve` with them would (load, quantise, compile, the warm-up
generations at the default size), writes the artifact to `--compile-artifact` (or `DICACHE_COMPILE_ARTIFACT`) and
exits without serving: the Kubernetes Job of deploy/ that makes it once per image and GPU type. An artifact of the
same key already in the store is left as it is (exit 0)."""

from __future__ import annotations

import argparse
import logging
import subprocess

from ..errors import ConfigError, DicacheError
from ..models import prefetch
from ..parallel import setup_from_args
from ..settings.profiles import cache_config as read_cache_config
from .serve_args import add_server_arguments, settings_from_args
from .speed import compile_artifact_store, speed_spec

HELP = (
    "start the model as `dicache serve` with the same options would (--compile implied), warm it up, write its "
    "compile artifact to --compile-artifact and exit (a Kubernetes Job makes it once per image and GPU type)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)


BYTECODE_WAIT_S = 600
"""How long `dicache warmup` waits for the store's bytecode to be written before it exits (a Job's pod ends with it)."""


def wait_for_bytecode(writer: subprocess.Popen | None, timeout: float = BYTECODE_WAIT_S) -> None:
    """Wait for the subprocess writing the store's bytecode (`artifact_bytecode.write_in_background`), so that a Job
    ending with this process does not kill it; past `timeout` (or on its failure) say so and go on: the artifact is
    whole without it, and a later start writes it."""
    if writer is None:
        return
    try:
        status = writer.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"dicache warmup: the modules' bytecode was not written within {timeout:.0f} s; left out", flush=True)
        return
    print(f"dicache warmup: the modules' bytecode {'written' if status == 0 else 'not written'}", flush=True)


def run(args: argparse.Namespace) -> int:
    try:  # the serve extra (fastapi): the server's start-up code
        from ..server.startup import StartupTimeline
    except ModuleNotFoundError as exc:
        raise DicacheError(f"dicache warmup needs the serve extra: pip install 'dicache[serve]' ({exc})") from None
    from .serve import start_backend  # the serve command's start-up, shared

    timeline = StartupTimeline()
    timeline.imports_done(prefetch.ENTERED)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.compile = True
    args.prepare_text_lengths = "off"  # per-thread attention plans: nothing of them goes into the artifact
    store = compile_artifact_store(args)
    if store is None:
        raise ConfigError(
            "dicache warmup: give the artifact's folder with --compile-artifact PATH or DICACHE_COMPILE_ARTIFACT"
        )
    settings = settings_from_args(args)
    cache_config = read_cache_config(args.profile)
    speed_spec(args)  # a bad --quantization-exclude stops here, before loading
    ctx = setup_from_args(args)
    try:
        backend = start_backend(args, ctx, cache_config, settings.workers, timeline)
        startup = backend.startup
        backend.close()
    finally:
        ctx.shutdown()
    wait_for_bytecode(backend.bytecode_writer)
    loaded = startup.get("compile_artifact", {})
    saved = startup.get("compile_artifact_saved", {})
    if loaded.get("status") == "loaded":
        print(f"dicache warmup: the artifact for this key is already in {store}: {loaded.get('path')}", flush=True)
        return 0
    if saved.get("status") != "saved":
        raise DicacheError(f"dicache warmup: no artifact written to {store}: {saved.get('message', 'not saved')}")
    print(f"dicache warmup: wrote {saved['path']} ({saved['files']} files, {saved['bytes'] / 1e6:.1f} MB)", flush=True)
    return 0
