"""What the documentation tells a user to run or open, found in Markdown and checked without running it: the command
lines of its code blocks, the repository paths it names and the links it makes (tests/test_documented_paths.py,
tests/test_results_page.py)."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP_FOLDERS = ("benchmarks", "experiments", "deploy", "scripts", "docs", "tests", "notebooks", "dicache", ".ci")
PATH = re.compile(r"(?<![\w/.$-])((?:" + "|".join(re.escape(f) for f in TOP_FOLDERS) + r")/[\w./-]*[\w/])")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
SCRIPT = re.compile(r"^(?:benchmarks|experiments|scripts)/[\w/]+\.(?:py|sh)$")
PROGRAMS = ("dicache", "python", "python3", "torchrun", "bash", "kubectl", "docker", "serve", "pip")


def code_blocks(text: str) -> list[str]:
    """The code of `text`'s fenced blocks and indented (4-space) blocks, one string per block."""
    blocks, fenced, current, lines = [], None, [], text.splitlines()
    for line in lines:
        if fenced is not None:
            if line.startswith("```"):
                blocks.append("\n".join(current))
                fenced, current = None, []
            else:
                current.append(line)
        elif line.startswith("```"):
            fenced = line[3:].strip()
        elif line.startswith("    ") and (current or not line.strip().startswith(("-", "*", "|"))):
            current.append(line[4:])
        elif current and not line.strip():
            current.append("")
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    return blocks


def command_lines(text: str) -> list[str]:
    """Each shell command of `text`'s code blocks (continuation lines joined, comments dropped) whose program is one
    of `PROGRAMS` after any leading `VAR=value` assignments; Python code blocks are skipped."""
    commands = []
    for block in code_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            for part in _split_on_operators(words):
                program = _program(part)
                if program and program[0] in PROGRAMS:
                    commands.append(shlex.join(part))
    return commands


def _split_on_operators(words: list[str]) -> list[list[str]]:
    parts, current = [], []
    for word in words:
        if word in ("&&", "||", ";", "|", "&"):  # "&": a command run in the background
            parts.append(current)
            current = []
        else:
            current.append(word)
    return [p for p in [*parts, current] if p]


def _program(words: list[str]) -> list[str]:
    """`words` without its leading `VAR=value` assignments."""
    i = 0
    while i < len(words) and re.fullmatch(r"[A-Za-z_]\w*=.*", words[i]):
        i += 1
    return words[i:]


def problem_with_command(command: str) -> str | None:
    """Why `command` would not run as written (None: it would, as far as can be told without running it):
    a `dicache` command line its parser refuses, a script or file that does not exist, a `--flag` a script does not
    define. Commands joined by `;` or `&&` are checked one by one."""
    parts = [part for part in re.split(r";|&&", command) if part.strip()]
    if len(parts) > 1:
        return next((found for found in map(problem_with_command, parts) if found is not None), None)
    words = _program(shlex.split(command))
    program, args = words[0], words[1:]
    if program == "torchrun":  # torchrun's own options, then a script or `-m module`
        while args and args[0].startswith("--") and not args[0].endswith((".py", ".sh")):
            args = args[2:] if "=" not in args[0] and len(args) > 1 and not args[1].startswith("-") else args[1:]
        program, args = "python", args
    if program in ("python", "python3") and args[:2] == ["-m", "dicache.cli"]:
        program, args = "dicache", args[2:]
    if program == "dicache":
        return _parse_dicache(args)
    if program in ("python", "python3", "bash") and args and SCRIPT.match(args[0]):
        script = ROOT / args[0]
        if not script.is_file():
            return f"{args[0]} does not exist"
        source = script.read_text()
        if args[0] == "benchmarks/sweep_results.py":  # passes the options it does not know on to `dicache sweep`
            source += "".join(p.read_text() for p in (ROOT / "dicache" / "commands").glob("*.py"))
        missing = [a.split("=")[0] for a in args[1:] if a.startswith("--") and a.split("=")[0] not in source]
        return f"{args[0]} defines no {', '.join(missing)}" if missing else None
    for flag, value in zip(args, args[1:]):  # kubectl apply -f FILE, docker build -f FILE
        if flag == "-f" and not (ROOT / value).exists():
            return f"{value} does not exist"
    return None


def _parse_dicache(args: list[str]) -> str | None:
    from dicache.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(args)
    except SystemExit as exit_:
        if exit_.code:
            return f"dicache refuses it: {err.getvalue().strip().splitlines()[-1] if err.getvalue() else exit_.code}"
    return None


def repository_paths(text: str) -> list[str]:
    """The repository paths `text` names (`benchmarks/...`, `docs/...`, ...), trailing dots dropped."""
    return sorted({match.rstrip(".") for match in PATH.findall(text)})


def links(text: str) -> list[str]:
    """The targets of `text`'s Markdown links and images that point into the repository (no scheme, no mailto)."""
    found = [a or b for a, b in LINK.findall(text)]
    return [t for t in found if not re.match(r"^[a-z]+:", t)]


def anchors(path: pathlib.Path) -> set[str]:
    """The fragments a link may name in Markdown file `path`: its `<a id="...">`s and its headings' GitHub slugs."""
    text = path.read_text()
    ids = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#+ (.+?)\s*$", text, re.MULTILINE):
        heading = re.sub(r"<[^>]+>", "", heading)
        ids.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return ids


def problem_with_link(document: pathlib.Path, target: str) -> str | None:
    """Why link `target` of `document` leads nowhere (None: it leads to an existing file, and anchor if it names
    one)."""
    file, _, fragment = target.partition("#")
    path = (document.parent / file).resolve() if file else document
    if not path.exists():
        return f"{target}: no such file"
    if fragment and path.suffix == ".md" and fragment not in anchors(path):
        return f"{target}: {path.name} has no anchor {fragment!r}"
    return None
