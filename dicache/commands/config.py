"""`dicache config`: the effective cache settings and where each value came from."""

from __future__ import annotations

import argparse
import json

HELP = "print the effective cache settings (SGLANG_CACHE_DIT_* variables) and where each value came from"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--env-example", action="store_true", help="print env.example (every variable and default)")


def run(args: argparse.Namespace) -> int:
    from ..config import CacheConfig, env_example

    if args.env_example:
        print(env_example(), end="")
        return 0
    config = CacheConfig.from_env()
    if args.json:
        print(json.dumps({"settings": config.model_dump(), "sources": config.sources()}, indent=2))
    else:
        print(config.describe())
    return 0
