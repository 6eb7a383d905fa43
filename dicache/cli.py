"""The `dicache` command line. Subcommands live in `dicache.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .errors import DicacheError
from .models import artifact_bytecode
from .models.prefetch import argv_request, start_prefetch

SUBCOMMANDS = ("generate", "serve", "warmup", "sweep", "calibrate", "config")
"""Module names under `dicache.commands`, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dicache",
        description="Step caching (DBCache + TaylorSeer) for Diffusion Transformer sampling, first-class Krea-2. "
        "Cache settings come from SGLANG_CACHE_DIT_* environment variables over an optional settings profile "
        "(--profile / SGLANG_CACHE_DIT_PROFILE, written by `dicache calibrate`); see `dicache config`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"dicache.commands.{name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    request = argv_request(argv)
    if request is not None:  # the store's bytecode and known distributions for the imports to come
        artifact_bytecode.prepare_imports(request["store"])
    start_prefetch(argv)  # before the commands' modules import torch: the disk works while the process imports
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except DicacheError as exc:
        print(f"dicache {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_status


if __name__ == "__main__":
    sys.exit(main())
