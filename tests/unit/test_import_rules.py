"""The layout's import rules (DESIGN.md, Layout), read from the code's import statements.

- ``proto`` (the wire contract) imports none of our packages, only itself;
- ``bus`` (NATS plumbing) imports ``proto`` and itself;
- ``services/common`` (shared pure code, not a service) imports ``proto``, ``bus`` and itself;
- a service (``services/<name>``) imports ``proto``, ``bus``, ``services.common`` and
  itself, never another service;
- ``ops`` and ``tests`` may import anything (not checked).

Every import counts: top-level, inside functions, relative ones resolved.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("proto", "bus", "services", "ops", "tests", "benchmarks")
SHARED = "services.common"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``; relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            # ``from services import router`` (or ``from ..admission import slo``) names modules
            package_level = target in OURS or (target.startswith("services.") and target.count(".") == 1)
            names = [f"{target}.{a.name}" for a in node.names] if package_level else [target]
            out.extend((node.lineno, name) for name in names)
    return out


def _owner(module: str) -> str | None:
    """The unit a module of ours belongs to: proto, bus, services.common, services.<name>, or
    another top-level package of ours; None for the standard library and third parties."""
    parts = module.split(".")
    if parts[0] not in OURS:
        return None
    if parts[0] == "services" and len(parts) > 1:
        return f"services.{parts[1]}"
    return parts[0]


def _allowed(unit: str) -> set[str]:
    if unit == "proto":
        return {"proto"}
    if unit == "bus":
        return {"bus", "proto"}
    if unit == SHARED:
        return {SHARED, "bus", "proto"}
    return {unit, SHARED, "bus", "proto"}  # a service


def violations(root: Path) -> list[str]:
    """Every import in ``root``'s proto/, bus/ and services/ that breaks the rules."""
    found: list[str] = []
    for top in ("proto", "bus", "services"):
        for path in sorted((root / top).rglob("*.py")):
            unit = _owner(_module_name(path, root))
            if unit is None or unit == "services":  # services/__init__.py: the namespace
                continue
            allowed = _allowed(unit)
            for line, target in _imports(path, root):
                owner = _owner(target)
                if owner is not None and owner not in allowed:
                    found.append(f"{path.relative_to(root)}:{line}: {unit} imports {target}")
    return found


def test_the_tree_keeps_the_import_rules() -> None:
    assert violations(ROOT) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for top in ("proto", "bus", "services"):
        (tmp_path / top).mkdir(exist_ok=True)
    return tmp_path


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("services/router/policy.py", "from services.admission.slo import ReplicaLoad\n",
         "services.router imports services.admission.slo"),
        ("services/router/policy.py", "def f():\n    import services.gateway.models\n",
         "services.router imports services.gateway.models"),
        ("services/router/policy.py", "from ..admission import slo\n", "services.router imports services.admission.slo"),
        ("services/router/policy.py", "from services import admission\n", "services.router imports services.admission"),
        ("services/common/fleet.py", "from services.router.policy import Router\n",
         "services.common imports services.router.policy"),
        ("proto/messages.py", "from bus.client import Bus\n", "proto imports bus.client"),
        ("proto/messages.py", "from services.common.kvindex import KvIndex\n", "proto imports services.common.kvindex"),
        ("bus/client.py", "from services.common import fleet\n", "bus imports services.common.fleet"),
        ("bus/client.py", "import ops.cli\n", "bus imports ops.cli"),
    ],
)
def test_a_broken_rule_is_named(tmp_path: Path, name: str, text: str, expected: str) -> None:
    root = _tree(tmp_path, {name: text})
    assert [v.split(": ", 1)[1] for v in violations(root)] == [expected]


def test_allowed_imports_pass(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "services/router/policy.py": "import msgspec\nfrom proto.messages import X\nfrom bus import Bus\n"
                                     "from services.common.fleet import FleetView\nfrom .view import Y\n",
        "services/common/feed.py": "from bus.registry import R\nfrom .fleet import FleetView\n",
        "bus/client.py": "from proto.codec import decode\nfrom .settings import S\n",
        "proto/kv.py": "from .hashing import h\nimport xxhash\n",
    })
    assert violations(root) == []


def test_every_data_file_the_code_ships_is_in_the_package_data() -> None:
    """A file an installed meshserve reads (the chat page, its icon, profiles, configs) must
    match pyproject's package-data, or a wheel (the container images) lacks it."""
    import fnmatch
    import subprocess
    import tomllib

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["*"]
    files = subprocess.run(["git", "ls-files", "proto", "bus", "services", "ops"], cwd=root, capture_output=True,
                           text=True, check=True).stdout.split()
    # Docs and the GPU check script are read in the repository, never by the installed code.
    shipped = [f for f in files if not f.endswith((".py", ".md", ".sh"))]
    assert shipped
    missing = [f for f in shipped if not any(fnmatch.fnmatch(Path(f).name, p) for p in patterns)]
    assert missing == [], f"not in [tool.setuptools.package-data]: {missing}"
