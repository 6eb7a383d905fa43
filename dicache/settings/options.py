"""Declared options: frozen pydantic models whose fields carry their command-line flag and help (`option`).

The command line derives its options from the declarations (`dicache.commands.fields`); the model validates once,
and a bad value raises one line naming the field (or its flag), the value and what is allowed (`Options`). Where
options arrive as a mapping instead (a Ray Serve builder's arguments), `option_values` hands each to the model that
declares it, by the option's name.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from ..errors import ConfigError
from ..formatting import clip_repr


def option(
    default: Any,
    *,
    flag: str | None = None,
    help: str = "",
    unit: str = "",
    default_text: str | None = None,
    repr: bool = True,
    metavar: str | None = None,
    switch: bool = False,
    choices: Sequence[str] | None = None,
    read: Callable[[str], Any] | None = None,
    repeat: bool = False,
    **rules: Any,
) -> Any:
    """A field declared with its command-line `flag` (None: not an option; no leading dash: a positional argument)
    and `help` (the CLI appends "(default: X)"). `unit`: what a number counts, in words ("seconds"). `default_text`:
    the default in words when it is decided elsewhere (the option's own default is then None). `rules` are
    pydantic's (ge, gt, le...); integers and numbers are strict (no bools, no strings) and numbers are finite.

    How the command line reads it (`dicache.commands.fields`), beyond what the type says (a `Literal` lists its
    choices, a `list[...]` takes one or more values): `metavar` (the value's name in the help), `switch` (a boolean
    that also takes true / false: `--flag`, `--flag false`, SGLang's form), `choices` (the accepted words of a text
    field that a check elsewhere enforces), `read` (text -> value for a form of its own, e.g. "WxH"; a ValueError is
    a usage error), `repeat` (a list given one value per occurrence: `--prompt a --prompt b`)."""
    extra = {
        "flag": flag,
        "unit": unit,
        "default_text": default_text,
        "metavar": metavar,
        "switch": switch,
        "choices": tuple(choices) if choices is not None else None,
        "read": read,
        "repeat": repeat,
    }
    return Field(default, description=help, json_schema_extra=extra, repr=repr, **rules)


def value_type(field: FieldInfo) -> Any:
    """The field's type without `| None`."""
    annotation = field.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = [a for a in get_args(annotation) if a is not type(None)]
    return annotation


def bounds(field: FieldInfo) -> dict[str, float]:
    """The field's declared bounds: {'ge': 0}, {'gt': 0, 'le': 1}..."""
    return {b: getattr(rule, b) for rule in field.metadata for b in ("ge", "gt", "le") if hasattr(rule, b)}


def allowed(field: FieldInfo) -> str:
    """What the field accepts, in words, from its type and bounds: 'an integer >= 1', 'a finite number > 0'."""
    kind = value_type(field)
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(kind))
    noun = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(kind, str(kind))
    found = bounds(field)
    if kind is int and "ge" in found and "le" in found:  # the command line's wording (commands.argtypes)
        return f"{noun} between {_number(found['ge'])} and {_number(found['le'])}"
    words = [f"{op} {_number(value)}" for op, value in _ops(found)]
    return " ".join([noun, " and ".join(words)]) if words else noun


def _ops(found: dict[str, float]) -> list[tuple[str, float]]:
    return [(op, found[b]) for b, op in (("ge", ">="), ("gt", ">"), ("le", "<=")) if b in found]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


class Options(BaseModel):
    """Base of declared options: frozen, unknown names refused, integers and numbers strict and finite.

    A bad value raises `error` (ValueError by default) with one line per problem, naming the field as `label`
    says ('{model}.{name}', '{name}' or '{flag}'), the value (never a field declared with repr=False) and what is
    allowed; a rule's own message (a ValueError raised by a field or model validator) is kept as it is. Models
    compose by inheritance: a model whose bases are option models declares their fields, each declared once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    label: ClassVar[str] = "{model}.{name}"
    error: ClassVar[type[Exception]] = ValueError
    group: ClassVar[tuple[str, str | None] | None] = None  # (title, description) of the options' heading in --help

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise self.error(_one_line(type(self), exc)) from None

    @classmethod
    def flag(cls, name: str) -> str:
        """The command-line flag declared for field `name` (`--dit-layerwise-offload`)."""
        return cls.model_fields[name].json_schema_extra["flag"]

    @classmethod
    def name_of(cls, name: str) -> str:
        """How field `name` is called in messages."""
        field = cls.model_fields.get(name)
        flag = (field.json_schema_extra or {}).get("flag") if field is not None else None
        return cls.label.format(model=cls.__name__, name=name, flag=flag or name)


class FlagOptions(Options):
    """Command-line options: a bad value is a `ConfigError` naming the flag (`--steps=-3 is invalid: ...`)."""

    label: ClassVar[str] = "{flag}"
    error: ClassVar[type[Exception]] = ConfigError


def _one_line(cls: type[Options], exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        if error["type"] == "value_error" and "error" in error.get("ctx", {}):
            problems.append(str(error["ctx"]["error"]))
            continue
        name = str(error["loc"][0]) if error["loc"] else ""
        field = cls.model_fields.get(name)
        if field is None:  # an unknown keyword
            problems.append(f"{cls.__name__}: unknown option {name!r}; allowed: {', '.join(cls.model_fields)}")
            continue
        shown = "=" + clip_repr(error["input"]) if field.repr else ""
        problems.append(f"{cls.name_of(name)}{shown} is invalid: must be {allowed(field)}")
    return "; ".join(dict.fromkeys(problems))


def flag_name(flag: str) -> str:
    """An option's name without its dashes, as argparse stores it and a Serve builder takes it (`--max-queue` ->
    `max_queue`)."""
    return flag.lstrip("-").replace("-", "_")


def option_names(model: type[Options]) -> dict[str, str]:
    """The model's fields that are options, by option name (`flag_name` of the flag): {option name: field name}."""
    flags = {name: (f.json_schema_extra or {}).get("flag") for name, f in model.model_fields.items()}
    return {flag_name(flag): name for name, flag in flags.items() if flag}


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def typed(field: FieldInfo, value: Any) -> Any:
    """`value` as the field's type when it is text for an integer, a number or a boolean (a `key=value` command line
    passes text); anything else unchanged, for the model to check and name."""
    if not isinstance(value, str):
        return value
    kind, text = value_type(field), value.strip().lower()
    try:
        if kind is bool and text in _TRUE + _FALSE:
            return text in _TRUE
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        pass
    return value


def option_values(
    values: Mapping[str, Any], models: Sequence[type[Options]], error: type[Exception] = ValueError
) -> dict[type[Options], dict[str, Any]]:
    """`values` (by option name) split among the `models` that declare them: {model: {field name: value}}, text
    converted by the field's type (`typed`). A name no model declares raises `error` listing the names they do."""
    owners = {name: (model, field) for model in models for name, field in option_names(model).items()}
    unknown = [name for name in values if name not in owners]
    if unknown:
        raise error(f"unknown option(s) {', '.join(map(clip_repr, unknown))}; allowed: {', '.join(owners)}")
    split: dict[type[Options], dict[str, Any]] = {model: {} for model in models}
    for name, value in values.items():
        model, field = owners[name]
        split[model][field] = typed(model.model_fields[field], value)
    return split
