"""The quoted figures, rendered from ONE data file (benchmarks/results/figures.yaml): the results page's claims, the
README's headline table and every other generated table of docs/, and the headline plot.

A generated block sits between `<!-- results: NAME ... -->` and `<!-- end of results: NAME -->`; NAME is a view of
the data file (`headline`, `precision`, ...), a claim whose figure is a table (`offload`, ...), or `page` (the
results page's list of claims, benchmarks/RESULTS.md only). Everything outside the blocks is written by hand.

    python benchmarks/results_page.py            # check: exit 1 naming every file whose blocks are stale
    python benchmarks/results_page.py --write    # rewrite the blocks in place (README.md, docs/*.md, RESULTS.md)
                                                 # and the plot benchmarks/results/plots/headline.png
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "results" / "figures.yaml"
PAGE = ROOT / "benchmarks" / "RESULTS.md"
ARCHIVE = ROOT / "benchmarks" / "results" / "archive"
PLOT = ROOT / "benchmarks" / "results" / "plots" / "headline.png"

START = re.compile(r"^<!-- results: ([\w-]+)\b.*-->$", re.MULTILINE)
CLAIM_KEYS = {"section", "claim", "figure", "detail", "table", "date", "machine", "command", "runs", "source"}
PLOTTED = {  # headline row (its first cell) -> the plot's panel title
    "one forward": "one forward (s)",
    "Turbo 8 steps, SGLang's default cache pattern": "Turbo 8, cached (s)",
    "Raw 50 steps CFG, SGLang's default cache pattern": "Raw 50 CFG, cached (s)",
    "Raw 50 steps CFG, cache-dit's `fast` mask (same work)": "Raw 50 CFG, cache-dit's fast mask (s)",
}


def documents() -> list[pathlib.Path]:
    """The files whose generated blocks are kept current: README.md, docs/*.md and the results page."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), PAGE]


def load(path: pathlib.Path = DATA, archive: pathlib.Path = ARCHIVE) -> dict[str, Any]:
    """The data file, checked: every claim has what its kind needs, every run is a file of `archive` that is not a
    "(partial)" one, every `{id}` of a view names a claim with a figure. Raises ValueError naming the problem."""
    data = yaml.safe_load(path.read_text())
    machines, sections, claims = data["machines"], data["sections"], data["claims"]
    for cid, claim in claims.items():
        where = f"{path.name}: claim {cid!r}"
        if set(claim) - CLAIM_KEYS:
            unknown = sorted(set(claim) - CLAIM_KEYS)
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(CLAIM_KEYS)}")
        if claim.get("section") not in sections:
            raise ValueError(f"{where}: section={claim.get('section')!r} is not one of {sorted(sections)}")
        if claim.get("machine") not in machines:
            raise ValueError(f"{where}: machine={claim.get('machine')!r} is not one of {sorted(machines)}")
        if ("figure" in claim) == ("table" in claim):
            raise ValueError(f"{where}: needs exactly one of 'figure' and 'table'")
        for row in claim.get("table", {}).get("rows", []):
            if len(row) != len(claim["table"]["columns"]) or not all(isinstance(cell, str) for cell in row):
                raise ValueError(f"{where}: table row {row!r} needs {len(claim['table']['columns'])} cells, each text")
        if "source" in claim:
            continue
        for key in ("claim", "date", "command", "runs"):
            if not claim.get(key):
                raise ValueError(f"{where}: {key!r} is missing (or give 'source' for a figure published by others)")
        for run in claim["runs"]:
            file = archive / run
            if not file.is_file():
                raise ValueError(f"{where}: run {run!r} is not a file of {archive}")
            if "(partial)" in file.read_text().splitlines()[0]:
                raise ValueError(f"{where}: run {run!r} is a partial run; quote a complete one")
    for name, view in data["views"].items():
        for row in view["rows"]:
            if len(row) != len(view["columns"]) or not all(isinstance(cell, str) for cell in row):
                width = len(view["columns"])
                raise ValueError(f"{path.name}: view {name!r}: row {row!r} needs {width} cells, each text")
            for ref in re.findall(r"\{([\w-]+)\}", " ".join(row)):
                if "figure" not in claims.get(ref, {}):
                    raise ValueError(f"{path.name}: view {name!r} quotes {{{ref}}}, which is no claim with a figure")
    return data


def _link(target: pathlib.Path, page: pathlib.Path) -> str:
    return pathlib.Path(os.path.relpath(target, page.parent)).as_posix()


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(_cell(c) for c in columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows),
    ]


def _run_links(claim: dict, page: pathlib.Path) -> str:
    def label(run: str) -> str:
        stamp = re.match(r"(\d{4}-\d{2}-\d{2})-(\d{2})(\d{2})-", run)
        return f"{stamp[1]} {stamp[2]}:{stamp[3]}" if stamp else run.removesuffix(".md")

    return ", ".join(f"[{label(run)}]({_link(ARCHIVE / run, page)})" for run in claim.get("runs", []))


def _measured(claim: dict, data: dict, page: pathlib.Path) -> str:
    """Where a table claim comes from, as one line under the table."""
    if "source" in claim:
        return f"Source: {claim['source']}."
    return (
        f"Measured {claim['date']} on {data['machines'][claim['machine']]}: `{claim['command']}` "
        f"(runs: {_run_links(claim, page)})."
    )


def render_view(data: dict, name: str, page: pathlib.Path) -> list[str]:
    """A view: its table, each `{id}` replaced by claim id's figure linked to its row on the results page; under it
    the caption and the commands (with their dates) that measured the figures."""
    view, claims = data["views"][name], data["claims"]

    def quote(match: re.Match) -> str:
        target = _link(PAGE, page) + f"#{match[1]}" if page != PAGE else f"#{match[1]}"
        return f"[{claims[match[1]]['figure']}]({target})"

    rows = [[re.sub(r"\{([\w-]+)\}", quote, cell) for cell in row] for row in view["rows"]]
    quoted = [claims[ref] for ref in re.findall(r"\{([\w-]+)\}", " ".join(" ".join(row) for row in view["rows"]))]
    measured = list(dict.fromkeys(f"`{c['command']}` ({c['date']})" for c in quoted if "command" in c))
    caption = f"_{view['caption'].strip()}_ Measured with: " + "; ".join(measured) + "."
    return [*_table(view["columns"], rows), "", caption]


def render_claim_table(data: dict, cid: str, page: pathlib.Path) -> list[str]:
    """A claim whose figure is a table: the table, then where it was measured."""
    claim = data["claims"][cid]
    return [*_table(claim["table"]["columns"], claim["table"]["rows"]), "", _measured(claim, data, page)]


def render_page(data: dict, page: pathlib.Path = PAGE) -> list[str]:
    """The results page's claims, each once: the machines, then per section a table of the claims with a figure
    (figure, date, machine, command by number, runs) with its commands listed below it, then each table claim under
    its own heading; the headline plot last."""
    claims = data["claims"]
    lines = ["### Machines", "", *_table(["name", "machine"], [[k, v] for k, v in data["machines"].items()]), ""]
    for key, section in data["sections"].items():
        members = {cid: c for cid, c in claims.items() if c["section"] == key}
        lines += [f"### {section['title']}", ""]
        if section.get("about"):
            lines += [section["about"].strip(), ""]
        scalar = [(cid, c) for cid, c in members.items() if "figure" in c]
        commands: list[str] = []  # the section's commands, each listed once under its table
        if scalar:
            rows = []
            for cid, c in scalar:
                figure = f"**{c['figure']}**" + (f"<br>{c['detail']}" if c.get("detail") else "")
                if "source" in c:
                    rows.append([f'<a id="{cid}"></a>{c["claim"]}', figure, "", c["machine"], c["source"], ""])
                    continue
                if c["command"] not in commands:
                    commands.append(c["command"])
                number = commands.index(c["command"]) + 1
                anchor = f'<a id="{cid}"></a>{c["claim"]}'
                rows.append([anchor, figure, str(c["date"]), c["machine"], f"({number})", _run_links(c, page)])
            lines += [*_table(["claim", "figure", "date", "machine", "command", "runs"], rows), ""]
            lines += [f"({n}) `{command}`  " for n, command in enumerate(commands, start=1)]
            lines += [""] if commands else []
        for cid, c in members.items():
            if "table" in c:
                lines += [f'#### <a id="{cid}"></a>{c["claim"].strip()}', "", *render_claim_table(data, cid, page), ""]
    lines += [f"![the headline figures against SGLang's and diffusers + cache-dit's]({_link(PLOT, page)})"]
    return lines


def render(data: dict, name: str, page: pathlib.Path) -> str:
    """The whole generated block `name` as it belongs in `page`, markers included."""
    if name == "page":
        body = render_page(data, page)
    elif name in data["views"]:
        body = render_view(data, name, page)
    elif "table" in data["claims"].get(name, {}):
        body = render_claim_table(data, name, page)
    else:
        raise ValueError(f"{page.name}: no view or table claim named {name!r} in {DATA.name}")
    start = f"<!-- results: {name} (generated from {_link(DATA, page)}: python benchmarks/results_page.py --write) -->"
    return "\n".join([start, *body, f"<!-- end of results: {name} -->"])


def blocks(text: str) -> list[tuple[str, int, int]]:
    """(name, start, end) of each generated block of `text`, end just after its end marker."""
    found = []
    for match in START.finditer(text):
        end_marker = f"<!-- end of results: {match[1]} -->"
        end = text.find(end_marker, match.start())
        if end < 0:
            raise ValueError(f"generated block {match[1]!r} has no {end_marker!r}")
        found.append((match[1], match.start(), end + len(end_marker)))
    return found


def refreshed(text: str, data: dict, page: pathlib.Path) -> str:
    """`text` with every generated block rendered anew."""
    for name, start, end in reversed(blocks(text)):
        text = text[:start] + render(data, name, page) + text[end:]
    return text


def plot(data: dict, path: pathlib.Path = PLOT) -> None:
    """The headline view's timed rows as bar charts, one panel per row, one bar per system that has a figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    view, claims = data["views"]["headline"], data["claims"]
    rows = [row for row in view["rows"] if row[0] in PLOTTED]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows), 2.8))
    for ax, row in zip(axes, rows):
        bars = []  # (label, value, text): a range "a–b" is drawn at its middle
        for column, cell in zip(view["columns"][1:], row[1:]):
            ref = re.fullmatch(r"\{([\w-]+)\}", cell)
            if ref:
                text = claims[ref[1]]["figure"]
                numbers = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", text)[:2]]
                value = sum(numbers) / len(numbers) if "–" in text else numbers[0]
                bars.append((column.replace(", ", "\n", 1), value, text))
        bars.reverse()  # the first column on top
        colors = ["#4c72b0" if label.startswith("dicache") else "#999999" for label, _, _ in bars]
        ax.barh([b[0] for b in bars], [b[1] for b in bars], color=colors)
        for y, (_, value, text) in enumerate(bars):
            ax.text(value, y, f" {text}", va="center", fontsize=8)
        ax.set_title(PLOTTED[row[0]], fontsize=10)
        ax.tick_params(labelsize=8)
        ax.set_xlim(0, max(b[1] for b in bars) * 1.45)
    fig.suptitle("Krea-2 on one H200, 1024² (lower is better)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale blocks and the plot")
    args = parser.parse_args(argv)
    data = load()
    stale = []
    for path in documents():
        text = path.read_text()
        new = refreshed(text, data, path)
        if new != text:
            stale.append(path.relative_to(ROOT).as_posix())
            if args.write:
                path.write_text(new)
    if args.write:
        plot(data)
        print("rewrote: " + (", ".join(stale) or "nothing (all current)") + f"; plot: {PLOT.relative_to(ROOT)}")
        return 0
    if stale:
        print("stale generated blocks in: " + ", ".join(stale) + " (run `python benchmarks/results_page.py --write`)")
        return 1
    print("every generated block is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
