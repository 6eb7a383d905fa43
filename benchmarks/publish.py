"""What a benchmark's `main` ends with: the command line it was run with, its tables in Markdown, and its section
printed and appended to a results file (`--results`, usually benchmarks/RESULTS.md)."""

from __future__ import annotations

import pathlib
import shlex
import sys
from collections.abc import Mapping, Sequence


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """`python benchmarks/<script> <args>` as a shell takes it, quoted where needed (`argv` None: this process's
    arguments)."""
    args = sys.argv[1:] if argv is None else argv
    return f"python benchmarks/{script} {shlex.join(args)}".strip()


def publish(text: str, results: str | pathlib.Path | None) -> None:
    """Print `text` and append it to `results` when given (a new file starts with a "# Benchmark results" title)."""
    print(text)
    if results:
        path = pathlib.Path(results)
        if not path.exists():
            path.write_text("# Benchmark results\n")
        with path.open("a") as fh:
            fh.write(text)


def markdown_table(rows: Sequence[Mapping], keys: Sequence[str] | None = None) -> list[str]:
    """The lines of a Markdown table of `rows`: a header of `keys` (default: every key of the rows, first seen
    first), the separator, and per row its values as `str` (an empty cell where a row lacks a key; a `|` inside a
    value escaped, so it stays in its cell)."""
    if keys is None:
        keys = list(dict.fromkeys(k for row in rows for k in row))
    return [
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
        *("| " + " | ".join(str(row.get(k, "")).replace("|", "\\|") for k in keys) + " |" for row in rows),
    ]
