"""Service config files: one loader for the services whose settings are dataclasses.

A service's config dataclasses hold its only defaults. A file (JSON, or TOML when its
name ends in ``.toml``) overrides them section by section, and command-line options
override the file: an option defaults to None (not given), ``given`` keeps the ones set,
and ``--help`` quotes the dataclass through ``default_of``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


def read_file(path: str | Path | None) -> dict[str, Any]:
    """The file's sections (``{}`` without a file). ValueError names the file."""
    if path is None:
        return {}
    p = Path(path)
    text = p.read_text()
    try:
        raw = tomllib.loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{p}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: expected an object of sections, not {type(raw).__name__}")
    return raw


def checked(kind: type[Any], spec: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``spec`` as keyword arguments of ``kind``; a key that is not a field is an error."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: expected a table of settings, not {type(spec).__name__}")
    unknown = set(spec) - {f.name for f in dataclasses.fields(kind)}
    if unknown:
        raise ValueError(f"{where}: unknown settings {sorted(unknown)}")
    return dict(spec)


def build(kind: type[T], spec: Mapping[str, Any], where: str) -> T:
    """``kind(**spec)``; a missing, unknown or invalid setting, or one of the wrong type
    (``"abc"`` for a number), is a ValueError naming ``where`` and the setting."""
    spec = checked(kind, spec, where)
    try:
        hints = typing.get_type_hints(kind)
    except Exception:  # an annotation only a type checker resolves: leave the types unchecked
        hints = {}
    for name, value in list(spec.items()):
        annotation = hints.get(name, Any)
        if isinstance(value, float) and value.is_integer() and int in _members(annotation):
            spec[name] = value = int(value)  # 32.0 in a TOML or JSON file means 32
        expected = _expected(annotation, value)
        if expected is not None:
            raise ValueError(f"{where}: {name} must be {expected}, not {_shown(value)}")
    try:
        return kind(**spec)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types of a union (``int | None`` → int, None), or the annotation alone."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, list, dict)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _expected(annotation: Any, value: Any) -> str | None:
    """What a setting of type ``annotation`` must be, when ``value`` is not that; None when
    it is (or when the type is not one a config file's values are checked against)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        wanted = [_expected(member, value) for member in typing.get_args(annotation)]
        if any(w is None for w in wanted):
            return None
        return " or ".join(dict.fromkeys(w for w in wanted if w))
    if annotation is type(None):
        return None if value is None else "null"
    if annotation is bool:
        return None if isinstance(value, bool) else "true or false"
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "a whole number"
    if annotation is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if annotation is str:
        return None if isinstance(value, str) else "a string"
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        return None if value in choices else "one of " + ", ".join(json.dumps(c) for c in choices)
    if origin is tuple:
        args = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            return "a list"
        if len(args) == 2 and args[1] is Ellipsis:
            items = [(args[0], v) for v in value]
            of = _expected(args[0], object())
            shape = f"a list of {_plural(of)}" if of else "a list"
        elif args:
            of = _expected(args[0], object()) if len(set(args)) == 1 else None
            shape = f"a list of {len(args)} {_plural(of)}" if of else f"a list of {len(args)}"
            if len(value) != len(args):
                return shape
            items = list(zip(args, value, strict=True))
        else:
            return None
        return shape if any(_expected(t, v) is not None for t, v in items) else None
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return None if isinstance(value, annotation) else f"a table of {annotation.__name__} settings"
    return None


def _plural(what: str | None) -> str:
    """"a number" → "numbers" (for "a list of numbers")."""
    if not what:
        return ""
    for article in ("a ", "an "):
        if what.startswith(article):
            what = what[len(article):]
    return what if what.endswith("s") else what + "s"


class Refusal(SystemExit):
    """What ``refuse`` raises: a ``SystemExit`` with the exit code, whose text is the message."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def refuse(service: str, message: str, code: int = 2) -> NoReturn:
    """End ``meshserve serve SERVICE`` before it starts: ``message`` as one line on stderr
    (``meshserve serve SERVICE: MESSAGE``, the CLI's style) and exit ``code`` (2: bad
    command-line input or config file; 1: something at run time, a port in use)."""
    print(f"meshserve serve {service}: {message}", file=sys.stderr)
    raise Refusal(message, code)


def file_problem(option: str, path: str | Path, exc: BaseException) -> str:
    """``OPTION PATH: why`` for a config file that could not be read or used: the OS's
    reason for a file that cannot be opened, else the loader's message (without the path
    again when it starts with it)."""
    if isinstance(exc, OSError) and exc.strerror:
        why = exc.strerror
    else:
        why = str(exc)
        for prefix in (f"{path}: ", f"{Path(path)}: "):
            if why.startswith(prefix):
                why = why[len(prefix):]
                break
    return f"{option} {path}: {why}"


def given(args: argparse.Namespace, options: Mapping[str, str]) -> dict[str, Any]:
    """The command-line options the user set, by config field (``options``: option dest →
    field name). Options default to None so that the dataclass's default applies."""
    return {name: getattr(args, dest) for dest, name in options.items() if getattr(args, dest, None) is not None}


def default_of(kind: type[Any], name: str) -> Any:
    """The default of the dataclass field ``name`` (for ``--help``)."""
    for f in dataclasses.fields(kind):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            break
    raise KeyError(f"{kind.__name__}.{name} has no default")
