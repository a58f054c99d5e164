"""The one place where a config field meets its user: its help text and,
where the user's form differs from the value the engine runs with, that
form's name, type and default.

Most fields are their own argument (`block_size`: the default and type of
the dataclass field). Others are resolved from an argument: `dtype` is a
`torch.dtype` given as "auto" or a name, `kv_offloading_size` in GiB
becomes `size_bytes`, a None that the engine decides becomes a number.
Such a field declares its argument's name, type and default beside its
own, once. `EngineArgs`, `rayvllm serve --help`, `serve run ... key=value`
and docs/CONFIG.md all read the arguments from here (`user_arguments`).
Imports nothing of rayvllm but its errors, so every config module can use it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any

from rayvllm.messages.errors import InvalidParameterError

_ARGS = "rayvllm.args"


class _FieldDefault:
    """An `ArgSpec` default that is the field's own."""

    def __repr__(self) -> str:
        return "the field's default"


_FIELD_DEFAULT: Any = _FieldDefault()


@dataclass(frozen=True)
class ArgSpec:
    """An argument that sets a config field. `name`, `type`, `default`:
    the argument's own where they differ from the field's (None, and
    _FIELD_DEFAULT: the field's)."""

    help: str
    name: str | None = None
    type: Any = None
    default: Any = _FIELD_DEFAULT


def config_field(
    help: str,
    default: Any = MISSING,
    *,
    arg_name: str | None = None,
    arg_type: Any = None,
    arg_default: Any = _FIELD_DEFAULT,
    also: tuple[ArgSpec, ...] = (),
    **kwargs: Any,
) -> Any:
    """A dataclass field that users set, with its default and help text.
    `arg_*`: the argument's name, type and default where they differ from
    the field's; `also`: further arguments that set the same field (vLLM's
    older names)."""
    spec = ArgSpec(help, arg_name, arg_type, arg_default)
    return dataclasses.field(default=default, metadata={_ARGS: (spec, *also)}, **kwargs)


@dataclass(frozen=True)
class Argument:
    """One user-facing argument, resolved: what `EngineArgs` declares and
    the command line and docs show. `owner.field` is the config field it sets."""

    name: str
    type: Any
    default: Any
    help: str
    owner: type
    field: str


def user_arguments(cls: type) -> list[Argument]:
    """The arguments of the fields of dataclass `cls`, in field order
    (fields without a `config_field` are the engine's own, not the user's);
    a default of MISSING: the argument is required."""
    out: list[Argument] = []
    for f in dataclasses.fields(cls):
        for spec in f.metadata.get(_ARGS, ()):
            default = f.default if spec.default is _FIELD_DEFAULT else spec.default
            annotation = _field_type(cls, f) if spec.type is None else spec.type
            out.append(Argument(spec.name or f.name, annotation, default, spec.help, cls, f.name))
    return out


def _field_type(cls: type, f: dataclasses.Field[Any]) -> Any:
    """Field `f`'s annotation, evaluated in `cls`'s module. One field at a
    time: `typing.get_type_hints(cls)` would evaluate every field's, and
    some name a type (`torch.dtype`) imported only for type checkers, so
    that building a config needs no torch."""
    if not isinstance(f.type, str):
        return f.type
    return eval(f.type, vars(sys.modules[cls.__module__]))  # noqa: S307 - our own annotations


def cli_flag(name: str) -> str:
    """vLLM's command-line spelling of an argument."""
    return "--" + name.replace("_", "-")


def format_default(value: Any) -> str:
    """A default as the command line's help and docs/CONFIG.md show it."""
    if value is MISSING:
        return "required"
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def type_name(annotation: Any) -> str:
    """An argument's type in words, e.g. `int | None`."""
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def parse_value(name: str, annotation: Any, value: Any) -> Any:
    """`value` converted to the argument's type when it arrives as text
    (`serve run ... key=value`, a command-line flag); other values are left
    to the model's validation. Where the type admits text (a JSON-or-dict
    field, a name) the text stays as it is. Errors name the argument."""
    if not isinstance(value, str):
        return value
    members = _members(annotation)
    if str in members or Any in members:
        return value
    text = value.strip()
    if type(None) in members and text.lower() in ("none", "null", ""):
        return None
    for kind in members:
        origin = typing.get_origin(kind) or kind
        if kind is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
        elif kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        elif origin in (dict, list):
            if origin is list and not text.startswith("["):
                return [item.strip() for item in text.split(",") if item.strip()]
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as e:
                raise InvalidParameterError(name, f"not valid JSON: {e}") from None
            if isinstance(parsed, origin):
                return parsed
    raise InvalidParameterError(name, f"expected {type_name(annotation)}, got {value!r}")
