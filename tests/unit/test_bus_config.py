"""``bus.config``: the config-file loader the services share."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bus.config import build, checked, default_of, given, read_file


@dataclass(frozen=True)
class Inner:
    name: str
    size: int = 4

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("size must be ≥ 1")


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(default_factory=lambda: Inner("x"))
    timeout_s: float = 2.0
    port: int | None = None


def test_read_file_json_toml_and_none(tmp_path: Path) -> None:
    assert read_file(None) == {}
    (tmp_path / "a.json").write_text('{"service": {"timeout_s": 1}}')
    (tmp_path / "a.toml").write_text("[service]\ntimeout_s = 1\n")
    assert read_file(tmp_path / "a.json") == read_file(str(tmp_path / "a.toml")) == {"service": {"timeout_s": 1}}


@pytest.mark.parametrize(("name", "text"), [("bad.json", "{not json"), ("bad.toml", "[x"), ("list.json", "[1]")])
def test_read_file_errors_name_the_file(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=name):
        read_file(tmp_path / name)


def test_build_checks_names_types_and_the_dataclass_own_rules() -> None:
    assert build(Inner, {"name": "a"}, "inner") == Inner("a")
    with pytest.raises(ValueError, match=r"inner: unknown settings \['sise'\]"):
        build(Inner, {"name": "a", "sise": 2}, "inner")
    with pytest.raises(ValueError, match=r"inner: .*name"):
        build(Inner, {}, "inner")  # a required setting missing
    with pytest.raises(ValueError, match="inner: size must be"):
        build(Inner, {"name": "a", "size": 0}, "inner")
    with pytest.raises(ValueError, match="inner: expected a table"):
        checked(Inner, 5, "inner")  # type: ignore[arg-type]


def test_given_keeps_only_the_options_set() -> None:
    args = argparse.Namespace(timeout=None, port=0, other="x")
    assert given(args, {"timeout": "timeout_s", "port": "port", "absent": "absent"}) == {"port": 0}


def test_default_of_reads_the_dataclass() -> None:
    assert default_of(Outer, "timeout_s") == 2.0
    assert default_of(Outer, "port") is None
    assert default_of(Outer, "inner") == Inner("x")
    with pytest.raises(KeyError):
        default_of(Inner, "name")
