"""Command-line options derived from declared option models (`dicache.settings.options.option`): one argparse option per
field with a flag, and the model's keyword arguments back from the parsed namespace."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic.fields import FieldInfo

from ..settings.options import Options, bounds, flag_name, value_type
from . import argtypes


def flagged(model: type[Options]) -> dict[str, FieldInfo]:
    """The model's fields that are command-line options, by field name, in declaration order."""
    return {name: f for name, f in model.model_fields.items() if (f.json_schema_extra or {}).get("flag")}


def add_options(parser: Any, model: type[Options], checked: bool = True) -> None:
    """Add one option per flagged field of `model` to `parser` (a parser or an argument group).

    The value type comes from the annotation; with `checked`, the field's bounds are checked while parsing
    (`argtypes`: a usage error naming the flag), else the model checks them when it is built. The help is the
    field's description with "(default: X)" appended (X: `default_text`, else the field's default).
    """
    for field in flagged(model).values():
        extra = field.json_schema_extra
        kind = value_type(field)
        shown = extra["default_text"] or _shown(field.default)
        help_text = f"{field.description} (default: {shown})" if shown is not None else field.description
        default = None if extra["default_text"] else field.default
        if kind is bool:
            parser.add_argument(extra["flag"], action="store_true", help=help_text)
        else:
            parser.add_argument(
                extra["flag"], type=_parse(field, kind, extra, checked), default=default, help=help_text
            )


def values_from_args(args: argparse.Namespace, model: type[Options]) -> dict[str, Any]:
    """The flagged fields' values in `args`, by field name."""
    return {name: getattr(args, flag_name(field.json_schema_extra["flag"])) for name, field in flagged(model).items()}


def _shown(default: Any) -> str | None:
    if default is None:
        return None
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"{default:g}" if isinstance(default, float) else str(default)


def _parse(field: FieldInfo, kind: Any, extra: dict[str, Any], checked: bool) -> Any:
    if kind is str:
        return None
    found = bounds(field) if checked else {}  # unchecked: the type only, the model names the bounds
    high = found.get("le")
    if kind is int:
        if "gt" in found:
            raise TypeError(f"{extra['flag']}: integers take ge / le bounds, not gt")
        low = int(found["ge"]) if "ge" in found else None
        return argtypes.integer(low, None if high is None else int(high))
    if kind is float:
        unit = f"of {extra['unit']}" if extra["unit"] else ""
        if "ge" in found:
            return argtypes.number(found["ge"], allow_low=True, unit=unit, high=high)
        return argtypes.number(found["gt"], unit=unit, high=high) if "gt" in found else argtypes.any_number
    raise TypeError(f"{extra['flag']}: no command-line type for {kind}")
