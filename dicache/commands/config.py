"""`dicache config`: the effective cache settings and where each value came from (default, profile, environment)."""

from __future__ import annotations

import argparse
import json

from ..settings.docs import env_example, markdown_table
from ..settings.options import Options, option
from ..settings.profiles import cache_config, describe_profile, profile_source
from .fields import add_options
from .shared import add_profile_argument

HELP = (
    "print the effective cache settings (SGLANG_CACHE_DIT_* variables over an optional settings profile) and where "
    "each value came from"
)


class ConfigOptions(Options):
    """What `dicache config` prints."""

    as_json: bool = option(False, flag="--json", help="print JSON instead of a table")
    env_example: bool = option(False, flag="--env-example", help="print env.example (every variable and default)")
    markdown: bool = option(False, flag="--markdown", help="print the settings table of docs/settings.md (Markdown)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, ConfigOptions)
    add_profile_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.env_example:
        print(env_example(), end="")
        return 0
    if args.markdown:
        print(markdown_table(), end="")
        return 0
    config = cache_config(args.profile)
    if args.json:
        print(
            json.dumps(
                {"settings": config.model_dump(), "sources": config.sources(), "profile": profile_source(config)},
                indent=2,
            )
        )
    else:
        print(config.describe())
        profile = describe_profile(config)
        if profile:
            print(profile)
    return 0
