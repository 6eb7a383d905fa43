"""What a benchmark's `main` ends with: the command line it was run with, and its Markdown section printed and
appended to a results file (`--results`, usually benchmarks/RESULTS.md)."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """`python benchmarks/<script> <args>` as the user typed it (`argv` None: this process's arguments)."""
    args = sys.argv[1:] if argv is None else argv
    return f"python benchmarks/{script} {' '.join(args)}".strip()


def publish(text: str, results: str | pathlib.Path | None) -> None:
    """Print `text` and append it to `results` when given."""
    print(text)
    if results:
        with open(results, "a") as fh:
            fh.write(text)
