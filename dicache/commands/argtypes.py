"""argparse value types that check ranges, so that a bad option is a one-line usage error naming the value and
what is allowed (never a traceback, never a nonsense limit such as a NaN timeout)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def integer(low: int | None, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (None: no bound on that side)."""
    if low is None:
        allowed = "an integer" if high is None else f"an integer <= {high}"
    else:
        allowed = f"an integer >= {low}" if high is None else f"an integer between {low} and {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be {allowed}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be {allowed}")
        return value

    return parse


def any_number(text: str) -> float:
    """Any float, nan and inf included (whoever takes it checks the value): only text that is no number fails."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be a number") from None


def number(
    low: float = 0.0, allow_low: bool = False, unit: str = "", high: float | None = None
) -> Callable[[str], float]:
    """A finite number (of `unit`, e.g. "seconds") > low (>= low with `allow_low`), and <= high when given."""
    allowed = f"a finite number {unit + ' ' if unit else ''}{'>=' if allow_low else '>'} {low:g}"
    allowed += f" and <= {high:g}" if high is not None else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be {allowed}") from None
        too_high = high is not None and value > high
        if not math.isfinite(value) or value < low or (value == low and not allow_low) or too_high:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be {allowed}")
        return value

    return parse


def seconds(low: float = 0.0, allow_low: bool = False) -> Callable[[str], float]:
    """A finite number of seconds > low (>= low with `allow_low`)."""
    return number(low, allow_low, unit="of seconds")


port = integer(1, 65535)
