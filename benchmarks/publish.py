"""What a benchmark's `main` ends with: the command line it was run with, its tables in Markdown, and `publish`:
the section printed, kept as one file of the run archive, and one line for it appended to the run log at the end of
the results page (`--results`, usually benchmarks/RESULTS.md; docs/benchmarks.md describes the layout).

    benchmarks/RESULTS.md                      the results page; its last section, "## Run log", gets one line per run
    benchmarks/results/archive/<run>.md        one file per run, as the benchmark wrote it: <run> is
                                               YYYY-MM-DD-HHMM-<script> (UTC, the script's name without .py)
"""

from __future__ import annotations

import datetime
import pathlib
import re
import shlex
import sys
from collections.abc import Mapping, Sequence

RUN_LOG_HEADING = "## Run log"
ARCHIVE = pathlib.Path("results") / "archive"
"""The run archive, relative to the results page's folder."""

_FIELD = re.compile(r"^(?:- )?(command|machine):\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_SCRIPT = re.compile(r"(?:benchmarks|experiments)/(\w+)\.py")


def command_line(script: str, argv: Sequence[str] | None, folder: str = "benchmarks") -> str:
    """`python <folder>/<script> <args>` as a shell takes it, quoted where needed (`argv` None: this process's
    arguments; `folder`: `experiments` for the probes there)."""
    args = sys.argv[1:] if argv is None else argv
    return f"python {folder}/{script} {shlex.join(args)}".strip()


def section_fields(text: str) -> dict[str, str]:
    """A section's title (its first `## ` heading), command (the first backquoted part of its `Command:` line, or the
    whole line) and machine (its `Machine:` line up to the first `;` or ` (`, then its comma-separated parts while
    they fit in 60 characters); '' where absent."""
    fields = {"title": "", "command": "", "machine": ""}
    heading = re.search(r"^## (.+?)\s*$", text, re.MULTILINE)
    if heading:
        fields["title"] = heading.group(1)
    for match in _FIELD.finditer(text):
        key, value = match.group(1).lower(), match.group(2)
        if fields[key]:
            continue
        if key == "command":
            quoted = re.search(r"`([^`]+)`", value)
            value = quoted.group(1) if quoted else value
        else:
            parts = re.split(r";| \(", value)[0].split(",")
            while len(parts) > 1 and len(",".join(parts)) > 60:
                parts.pop()
            value = ",".join(parts).strip()
        fields[key] = value
    return fields


def script_name(text: str) -> str:
    """The benchmark a section comes from: the `benchmarks/<name>.py` (or `experiments/`) its command names, else
    the `<name>.py` its title names, else its title as a slug."""
    fields = section_fields(text)
    match = _SCRIPT.search(fields["command"]) or re.search(r"`(\w+)\.py`", fields["title"])
    if match:
        return match.group(1)
    slug = re.sub(r"[^a-z0-9]+", "-", fields["title"].lower()).strip("-")
    return slug[:48].rstrip("-") or "run"


def run_log_line(when: str, text: str, link: str) -> str:
    """One run-log line: `- <when> · <title> · `<command>` · <machine> · [<file>](<link>)` (empty parts left out)."""
    fields = section_fields(text)
    parts = [when, fields["title"] or script_name(text)]
    if fields["command"]:
        parts.append(f"`{fields['command']}`")
    if fields["machine"]:
        parts.append(fields["machine"])
    parts.append(f"[{pathlib.PurePosixPath(link).name}]({link})")
    return "- " + " · ".join(part.replace("\n", " ") for part in parts) + "\n"


def new_results_page(path: pathlib.Path) -> None:
    """A results page with nothing but the run log (what `publish` starts when `path` does not exist)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# Benchmark results\n\n{RUN_LOG_HEADING}\n\n")


def publish(
    text: str, results: str | pathlib.Path | None, *, now: datetime.datetime | None = None
) -> pathlib.Path | None:
    """Print `text`; with `results` (the results page) also write `text` as a new archive file next to it
    (`results/archive/YYYY-MM-DD-HHMM-<script>.md`, `-2`, `-3`, ... when taken) and append its run-log line to the
    page. Returns the archive file (None without `results`). `now`: the run's time (default: now, UTC)."""
    print(text)
    if not results:
        return None
    page = pathlib.Path(results)
    if not page.exists():
        new_results_page(page)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    archive = page.parent / ARCHIVE
    archive.mkdir(parents=True, exist_ok=True)
    stem = f"{now:%Y-%m-%d-%H%M}-{script_name(text)}"
    path, n = archive / f"{stem}.md", 1
    while path.exists():
        n += 1
        path = archive / f"{stem}-{n}.md"
    body = text.lstrip("\n")
    path.write_text(body if body.endswith("\n") else body + "\n")
    page_text = page.read_text()
    with page.open("a") as fh:
        if RUN_LOG_HEADING not in page_text:
            fh.write(f"\n{RUN_LOG_HEADING}\n\n")
        elif not page_text.endswith("\n"):
            fh.write("\n")
        fh.write(run_log_line(f"{now:%Y-%m-%d %H:%M} UTC", body, (ARCHIVE / path.name).as_posix()))
    return path


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
