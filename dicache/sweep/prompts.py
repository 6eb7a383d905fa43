"""Prompt sets of `sweep` and `calibrate`: prompt files, the built-in fallback prompts, (prompt, seed) samples."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import SweepSpecError, as_int
from .files import read_data_file

FALLBACK_PROMPTS = (
    "red apple",
    "grinning face",
    "rocket",
    "dog face",
    "pizza",
    "snowman",
    "sun with face",
    "soccer ball",
)


def read_prompts(path: str | Path, split: str | None = None) -> list[tuple[str, int | None]]:
    """(prompt, seed or None) pairs from a text file (one prompt a line) or JSON: a list of strings, a list of
    `{"prompt", "seed"}` objects, or an object with `prompts` (such a list) and optionally `seeds` (then every prompt
    gets every seed). With `split`, only entries whose `"split"` equals it (the embedded held-out set marks
    `heldout` / `train`) are kept, when the file has splits."""
    p = Path(path)
    if not p.is_file():
        raise SweepSpecError(f"prompt file {str(path)!r} does not exist")
    if p.suffix.lower() != ".json":
        return [(line.strip(), None) for line in p.read_text().splitlines() if line.strip()]
    data = read_data_file(p, "prompt file", SweepSpecError, unparsable=" is not valid JSON")
    if isinstance(data, Mapping):
        items, seeds = data.get("prompts"), data.get("seeds")
    else:
        items, seeds = data, None
    if not isinstance(items, list) or not items:
        raise SweepSpecError(f"prompt file {str(path)!r}: expected a non-empty list of prompts")
    if split is not None and any(isinstance(i, Mapping) and "split" in i for i in items):
        items = [i for i in items if isinstance(i, Mapping) and i.get("split") == split]
    pairs: list[tuple[str, int | None]] = []
    for item in items:
        if isinstance(item, str):
            pairs.append((item, None))
        elif isinstance(item, Mapping) and isinstance(item.get("prompt"), str):
            seed = item.get("seed")
            pairs.append((item["prompt"], None if seed is None else as_int(seed, f"seed of {item['prompt']!r}")))
        else:
            raise SweepSpecError(f"prompt file {str(path)!r}: entry {item!r} is neither a string nor {{'prompt': ...}}")
    if seeds is not None:
        pairs = [(prompt, as_int(s, "seed")) for prompt, _ in pairs for s in seeds]
    return pairs


def make_samples(
    pairs: Sequence[tuple[str, int | None]], seeds: Sequence[int] | None, limit: int | None = None
) -> list[tuple[str, int]]:
    """(prompt, seed) samples: with `seeds`, every prompt with every seed; else each pair's own seed (0 if none).
    `limit` keeps the first `limit` prompts."""
    prompts = list(dict.fromkeys(p for p, _ in pairs))
    if limit is not None:
        if limit < 1:
            raise SweepSpecError(f"num_prompts={limit} is invalid: must be >= 1")
        keep = set(prompts[:limit])
        pairs = [pair for pair in pairs if pair[0] in keep]
        prompts = prompts[:limit]
    if seeds is not None:
        return [(p, int(s)) for p in prompts for s in seeds]
    return list(dict.fromkeys((p, 0 if s is None else int(s)) for p, s in pairs))
