"""The placement hot path compiled with mypyc, used only while it matches the source.

``build()`` (``make install`` runs it) compiles ``MODULES``
into ``<venv>/meshserve-native/`` with a manifest of their sources' hashes. On import
``services`` calls ``install()``: when every listed source still hashes as built (and
``MESHSERVE_NATIVE`` is not ``0``), a finder serves those modules from the compiled
build; otherwise nothing changes and they run as plain Python. All or none: a compiled
class cannot be subclassed by an interpreted one, so a stale build is never mixed in.
Without a C compiler the build says so and the mesh runs as plain Python, just slower
(``benchmarks/router_decision.py`` times both).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

# The placement decision and what it reads (issue 19: ≤ 50 µs at 64 workers).
MODULES = (
    "services.common.kvindex",
    "services.common.fleet",
    "services.router.decision",
    "services.router.context",
    "services.router.policy_config",
    "services.router.policy",
)
ROOT = Path(__file__).resolve().parents[2]
ENV = "MESHSERVE_NATIVE"


def build_dir() -> Path:
    return Path(sys.prefix) / "meshserve-native"


def source_of(module: str, root: Path = ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fresh(manifest: dict[str, object], root: Path = ROOT) -> bool:
    """The build is for this interpreter and every compiled module's source is unchanged."""
    sources = manifest.get("sources")
    if manifest.get("cache_tag") != sys.implementation.cache_tag or not isinstance(sources, dict):
        return False
    if set(sources) != set(MODULES):
        return False
    try:
        return all(digest(source_of(m, root)) == h for m, h in sources.items())
    except OSError:
        return False


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


_state = {"active": False, "why": "not checked"}


def install() -> bool:
    """Serve ``MODULES`` from the compiled build when it is fresh; ``status()`` says why not."""
    if _state["active"]:
        return True
    if os.environ.get(ENV, "1") == "0":
        _state["why"] = f"{ENV}=0"
        return False
    out = build_dir()
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        _state["why"] = "not built (make install)"
        return False
    if not isinstance(manifest, dict):
        _state["why"] = "build incomplete (make install)"
        return False
    if not fresh(manifest):
        _state["why"] = "source changed since the build (make install)"
        return False
    try:
        files = {str(name): out / str(rel) for name, rel in manifest["files"].items()}
    except (KeyError, TypeError, AttributeError):
        files = {}
    if not files or not all(f.is_file() for f in files.values()):
        _state["why"] = "build incomplete (make install)"
        return False
    sys.meta_path.insert(0, _Finder(files))
    _state.update(active=True, why="")
    return True


def status() -> str:
    """One line for logs: compiled or plain Python, and why."""
    return "compiled (mypyc)" if _state["active"] else f"plain Python ({_state['why']})"


def build(out: Path | None = None) -> Path:
    """Compile ``MODULES`` with mypyc into ``out`` (default ``build_dir()``) and write the manifest."""
    from mypyc.build import mypycify  # a dev dependency: only the build needs it
    from setuptools import Distribution  # type: ignore[import-untyped]

    out = out or build_dir()
    sources = {m: digest(source_of(m)) for m in MODULES}
    with tempfile.TemporaryDirectory(prefix="meshserve-native-") as tmp:
        # Compile from a directory holding only the packages: module names follow the
        # paths, and setuptools must not read the project's pyproject.toml here.
        work = Path(tmp) / "src"
        work.mkdir()
        for pkg in ("services", "proto", "bus", "ops"):
            (work / pkg).symlink_to(ROOT / pkg)
        cwd = os.getcwd()
        os.chdir(work)
        try:
            exts = mypycify([str(source_of(m, Path("."))) for m in MODULES], opt_level="3")
            dist = Distribution({"name": "meshserve-native", "ext_modules": exts})
            staging = Path(tmp) / "lib"
            dist.script_args = ["-q", "build_ext", "--build-lib", str(staging), "--build-temp", str(Path(tmp) / "tmp")]
            dist.parse_command_line()
            dist.run_commands()
        finally:
            os.chdir(cwd)
        files: dict[str, str] = {}
        for so in staging.rglob("*.so"):
            rel = so.relative_to(staging)
            name = ".".join((*rel.parts[:-1], rel.name.split(".", 1)[0]))
            files[name] = str(rel)
        missing = [m for m in MODULES if m not in files]
        if missing:
            raise RuntimeError(f"mypyc built no extension for {', '.join(missing)}")
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staging, out)
    manifest = {"cache_tag": sys.implementation.cache_tag, "sources": sources, "files": files}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def main() -> int:
    """``make install``'s step: build, or say why the mesh stays plain Python (never fails)."""
    try:
        out = build()
    except Exception as e:  # no compiler, no mypyc: the mesh still runs, as plain Python
        print(f"meshserve: placement stays plain Python (compiling it failed: {type(e).__name__}: {e})", file=sys.stderr)
        return 0
    print(f"meshserve: placement compiled with mypyc into {out}")
    return 0

