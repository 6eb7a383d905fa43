"""Command-line options derived from declared option models (`dicache.settings.options.option`): one argparse option
per field with a flag, and the model's keyword arguments back from the parsed namespace.

What argparse gets comes from the declaration alone: the flag, the help (with "(default: X)"), the value type and
its bounds (checked while parsing: a bad value is a usage error naming the flag), the choices of a `Literal`, one or
more values for a `list[...]`, and the declaration's command-line extras (`metavar`, `switch`, `choices`, `read`,
`repeat`). A model's `group` (title, description) puts its options under their own heading in the help.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args, get_origin

from pydantic.fields import FieldInfo

from ..settings.options import Options, bounds, flag_name, value_type
from . import argtypes


def flagged(model: type[Options], only: Iterable[str] | None = None) -> dict[str, FieldInfo]:
    """The model's fields that are command-line options (all of them, or those named in `only`), by field name, in
    declaration order."""
    wanted = None if only is None else set(only)
    return {
        name: f
        for name, f in model.model_fields.items()
        if (f.json_schema_extra or {}).get("flag") and (wanted is None or name in wanted)
    }


def add_options(
    parser: Any,
    model: type[Options],
    checked: bool = True,
    *,
    only: Iterable[str] | None = None,
    aliases: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """Add one option per flagged field of `model` (or of the fields named in `only`) to `parser` (a parser or an
    argument group; a model with a `group` gets its own group of `parser`).

    The value type comes from the annotation; with `checked`, the field's bounds are checked while parsing
    (`argtypes`: a usage error naming the flag), else the model checks them when it is built. The help is the
    field's description with "(default: X)" appended (X: `default_text`, else the field's default). `aliases`:
    more flags for a field, by field name (`{"variant": ("--preset",)}`).
    """
    group = getattr(model, "group", None)
    if group is not None and hasattr(parser, "add_argument_group"):
        parser = parser.add_argument_group(*group)
    for name, field in flagged(model, only).items():
        flags = (field.json_schema_extra["flag"], *(aliases or {}).get(name, ()))
        parser.add_argument(*flags, **argument(field, checked))


def argument(field: FieldInfo, checked: bool = True) -> dict[str, Any]:
    """`add_argument`'s keyword arguments for a declared field (see `add_options`)."""
    extra = field.json_schema_extra
    kind = value_type(field)
    plain_flag = kind is bool and not extra["switch"]  # a flag is off unless given: no default to show
    shown = None if plain_flag or field.is_required() else extra["default_text"] or _shown(field.default)
    help_text = f"{field.description} (default: {shown})" if shown is not None else field.description
    spec: dict[str, Any] = {"help": help_text}
    if extra["metavar"]:
        spec["metavar"] = extra["metavar"]
    if kind is bool:
        if extra["switch"]:
            return {**spec, "action": Switch, "default": field.default}
        return {**spec, "action": "store_true"}
    if not extra["flag"].startswith("-"):  # a positional argument: always given
        return {**spec, "nargs": "+" if get_origin(kind) is list else None, "type": _parse(field, _item(kind), checked)}
    spec["default"] = None if extra["default_text"] else field.default
    if get_origin(kind) is list:  # one value per occurrence of the flag, or one or more values after it
        if extra["repeat"]:
            spec["action"] = "append"
        else:
            spec["nargs"] = "+"
        kind = _item(kind)
    if get_origin(kind) is Literal:
        spec["choices"] = get_args(kind)
    elif extra["choices"]:
        spec["choices"] = extra["choices"]
    parse = _parse(field, kind, checked)
    if parse is not None:
        spec["type"] = parse
    return spec


def values_from_args(
    args: argparse.Namespace, model: type[Options], only: Iterable[str] | None = None
) -> dict[str, Any]:
    """The flagged fields' values in `args` (all of them, or those named in `only`), by field name."""
    fields = flagged(model, only)
    return {name: getattr(args, flag_name(field.json_schema_extra["flag"])) for name, field in fields.items()}


class Switch(argparse.Action):
    """`--flag` (on), `--flag true|false` (SGLang's boolean options); another word is a usage error naming it."""

    TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")

    def __init__(self, option_strings, dest, default=False, help=None, metavar=None):
        super().__init__(option_strings, dest, nargs="?", const=True, default=default, help=help, metavar=metavar)

    def __call__(self, parser, namespace, value, option_string=None):
        if isinstance(value, str):
            lowered = value.strip().lower()
            if lowered not in self.TRUE + self.FALSE:
                parser.error(f"{option_string}={value!r} is invalid: must be true or false (or no value: true)")
            value = lowered in self.TRUE
        setattr(namespace, self.dest, bool(value))


def _item(kind: Any) -> Any:
    """The element type of `list[T]`; any other type as it is."""
    return get_args(kind)[0] if get_origin(kind) is list else kind


def _shown(default: Any) -> str | None:
    if default is None:
        return None
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"{default:g}" if isinstance(default, float) else str(default)


def _parse(field: FieldInfo, kind: Any, checked: bool) -> Any:
    extra = field.json_schema_extra
    if extra["read"] is not None:
        return _reader(extra["read"])
    if kind is str or get_origin(kind) is Literal:
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


def _reader(read: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            return read(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse
