"""Option groups that several commands take, added from their declarations (`fields.add_options`), and the
declaration of the run options that only commands read (`RunOptions`: `dicache sweep`, `dicache calibrate`)."""

from __future__ import annotations

import argparse

from ..parallel.options import ParallelOptions
from ..settings.options import FlagOptions, option
from ..settings.profiles import ProfileOption
from .fields import add_options


class RunOptions(FlagOptions):
    """How an evaluation command runs on this machine."""

    threads: int | None = option(
        None,
        flag="--threads",
        ge=1,
        default_text="torch's",
        help="torch CPU threads while running; 1 is often fastest on a shared or loaded CPU",
    )
    no_progress: bool = option(False, flag="--no-progress", help="no progress bar")


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """`--ulysses-degree N`, `--tp-size N` (`ParallelOptions`); a bad degree is named by `check_degrees` when the
    process group is set up, beside the count of processes launched."""
    add_options(parser, ParallelOptions, checked=False)


def add_profile_argument(parser: argparse.ArgumentParser) -> None:
    """`--profile PATH` (`ProfileOption`)."""
    add_options(parser, ProfileOption)
