"""docs/request-path.md names real code: every `file.py:Name` / `file.py:Class.method` in it is
defined in that file, and every bare `Class.method` in one of the files it names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"`([\w/]+\.py):([\w.]+)`")
BARE = re.compile(r"`([A-Z]\w+\.\w+)`")


def _source(file: str) -> Path:
    under_services = ROOT / "services" / file
    return under_services if under_services.exists() else ROOT / file


def _defines(path: Path, dotted: str) -> bool:
    if not path.exists():
        return False
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        node = next((n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                     and n.name == part), None)
        if node is None:  # a field of a class (dataclass or Struct)?
            return any(isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == part
                       for n in scope)
        scope = node.body
    return True


def test_every_named_function_exists() -> None:
    text = (ROOT / "docs" / "request-path.md").read_text()
    references = REFERENCE.findall(text)
    assert len(references) >= 20  # the doc walks the whole path
    missing = [f"{file}:{name}" for file, name in references if not _defines(_source(file), name)]
    files = {_source(file) for file, _ in references}
    missing += [name for name in BARE.findall(text) if not any(_defines(path, name) for path in files)]
    assert not missing, missing
