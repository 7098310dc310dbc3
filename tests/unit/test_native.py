"""The compiled placement path (services/common/native.py): used only while it matches
its sources, all modules or none, and built by ``make install`` from the same list."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import native

ROOT = Path(__file__).resolve().parents[2]


def _manifest(root: Path) -> dict[str, object]:
    return {
        "cache_tag": sys.implementation.cache_tag,
        "sources": {m: native.digest(native.source_of(m, root)) for m in native.MODULES},
    }


def _tree(tmp_path: Path) -> Path:
    for m in native.MODULES:
        src = native.source_of(m, tmp_path)
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(f"# {m}\n")
    return tmp_path


def test_a_build_of_these_sources_is_fresh(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    assert native.fresh(_manifest(root), root)


def test_an_edited_source_makes_the_build_stale(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    manifest = _manifest(root)
    native.source_of("services.router.policy", root).write_text("# edited\n")
    assert not native.fresh(manifest, root)


def test_another_interpreter_or_module_list_makes_the_build_stale(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    other_python = {**_manifest(root), "cache_tag": "cpython-399"}
    assert not native.fresh(other_python, root)
    sources = dict(_manifest(root)["sources"])  # type: ignore[call-overload]
    sources.pop("services.common.fleet")
    assert not native.fresh({**_manifest(root), "sources": sources}, root)
    native.source_of("services.common.kvindex", root).unlink()
    assert not native.fresh(_manifest_without_read(root), root)


def _manifest_without_read(root: Path) -> dict[str, object]:
    return {"cache_tag": sys.implementation.cache_tag, "sources": dict.fromkeys(native.MODULES, "0" * 64)}


def test_the_makefile_rebuilds_on_every_compiled_source() -> None:
    text = (ROOT / "Makefile").read_text()
    block = re.search(r"NATIVE_SOURCES := (.*?)\n(?!\t)", text, re.S)
    assert block is not None
    listed = set(block.group(1).replace("\\", " ").split())
    wanted = {str(native.source_of(m, Path("."))) for m in native.MODULES} | {"services/common/native.py"}
    assert listed == wanted


def _loaded_from(env: dict[str, str]) -> dict[str, str]:
    code = (
        "import json, importlib; from services.common import native; "
        f"print(json.dumps({{m: importlib.import_module(m).__file__ for m in {native.MODULES!r}}} | "
        "{'status': native.status()}))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_native_off_runs_every_module_as_python() -> None:
    import os

    files = _loaded_from({**os.environ, native.ENV: "0"})
    assert files.pop("status") == f"plain Python ({native.ENV}=0)"
    assert all(f.endswith(".py") for f in files.values())


def test_a_fresh_build_serves_every_module_compiled() -> None:
    import os

    manifest_file = native.build_dir() / "manifest.json"
    if not manifest_file.is_file() or not native.fresh(json.loads(manifest_file.read_text())):
        pytest.skip("no fresh mypyc build in this environment (make install builds it)")
    files = _loaded_from({k: v for k, v in os.environ.items() if k != native.ENV})
    assert files.pop("status") == "compiled (mypyc)"
    assert all(f.endswith(".so") and f.startswith(str(native.build_dir())) for f in files.values())


def test_a_damaged_build_leaves_every_module_python_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a manifest that lists fresh sources but no files, or is not an object at all, never
    # breaks an import: the mesh runs as plain Python and the router's log says why
    monkeypatch.setattr(native, "build_dir", lambda: tmp_path)
    monkeypatch.setitem(native._state, "active", False)
    monkeypatch.delenv(native.ENV, raising=False)
    before = list(sys.meta_path)
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest(ROOT)))
    assert native.install() is False
    assert native.status() == "plain Python (build incomplete (make install))"
    (tmp_path / "manifest.json").write_text("[1, 2]")
    assert native.install() is False
    assert native.status() == "plain Python (build incomplete (make install))"
    assert sys.meta_path == before
