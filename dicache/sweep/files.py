"""Reading the JSON and YAML input files of `sweep` and `calibrate` (grid files, candidate lists, prompt files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_data_file(
    path: str | Path,
    what: str,
    error: type[Exception],
    *,
    missing: str = " does not exist",
    unparsable: str = " cannot be parsed",
) -> Any:
    """The content of a YAML (.yaml/.yml) or JSON (any other name) file. A missing file raises
    `error(f"{what} {path!r}{missing}")`; one that does not parse `error(f"{what} {path!r}{unparsable}: <why>")`."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {str(path)!r}{missing}")
    text = p.read_text()
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text)
        return json.loads(text)
    except Exception as exc:  # json and yaml raise their own types; the message names the file
        raise error(f"{what} {str(path)!r}{unparsable}: {exc}") from None
