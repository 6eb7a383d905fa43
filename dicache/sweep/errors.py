"""The sweep's input error and the integer reading its inputs share."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


class SweepSpecError(ConfigError):
    """A bad sweep input (grid key, value, schedule, prompt file); the message names it and what is allowed."""


def as_int(value: Any, what: str) -> int:
    """`value` as an int (a bool or a non-integer raises `SweepSpecError` naming `what`)."""
    if isinstance(value, bool):
        raise SweepSpecError(f"{what}={value!r} is invalid: must be an integer")
    try:
        number = int(str(value))
    except (TypeError, ValueError):
        raise SweepSpecError(f"{what}={value!r} is invalid: must be an integer") from None
    return number
