"""``ops.up.Mesh.plan``: which processes a local mesh starts, with which arguments."""

from __future__ import annotations

from pathlib import Path

from ops.up import Mesh, MeshConfig


def argv_of(mesh: Mesh) -> dict[str, list[str]]:
    return {p.label: p.argv for p in mesh.plan()}


def test_service_args_reach_their_service_only(tmp_path: Path) -> None:
    mesh = Mesh(MeshConfig(state_dir=tmp_path, services=("worker", "router", "admission", "gateway"), workers=2,
                           worker_args=["--num-kv-blocks", "64"],
                           service_args={"router": ["--policy", "least_load"], "worker": ["--gauge-interval", "0.1"]}))
    argv = argv_of(mesh)
    assert argv["router"] == ["--policy", "least_load"]
    assert argv["admission"] == []
    for label in ("worker-1", "worker-2"):
        assert argv[label][-4:] == ["--num-kv-blocks", "64", "--gauge-interval", "0.1"]
    assert "--admission-unreachable" not in argv["gateway"]  # admission is there


def test_a_mesh_without_admission_fails_open_on_purpose(tmp_path: Path) -> None:
    argv = argv_of(Mesh(MeshConfig(state_dir=tmp_path, services=("worker", "router", "gateway"), workers=1)))
    assert argv["gateway"][-2:] == ["--admission-unreachable", "open"]
