"""How values appear in messages and tables: one spelling for lists, one way to cut long input short."""

from __future__ import annotations

from typing import Any


def show_value(value: Any) -> str:
    """A setting's value as users write it: lists comma-joined (``8,3,3``), anything else `str`."""
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def clip_repr(value: Any, limit: int = 100) -> str:
    """`repr(value)`, cut to about `limit` characters with the full length stated (a request can send megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"
