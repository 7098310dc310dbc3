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
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

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
    """``kind(**spec)``; a missing, unknown or invalid setting is a ValueError naming ``where``."""
    try:
        return kind(**checked(kind, spec, where))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc


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
