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


def test_up_with_the_echo_engine_starts_echo_workers_under_the_autoscaler(tmp_path: Path) -> None:
    import argparse

    from ops.up_cli import add_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    config = config_from_args(parser.parse_args(["up", "--engine", "echo", "--state-dir", str(tmp_path)]))
    assert (config.engine, config.model) == ("echo", "echo")
    argv = argv_of(Mesh(config))
    if "autoscaler" in argv:  # the default: the autoscaler starts the pool's workers itself
        worker_args = argv["autoscaler"][argv["autoscaler"].index("--worker-args") + 1].split()
        assert worker_args[:2] == ["--engine", "echo"] and "--speed" not in worker_args
    fixed = Mesh(MeshConfig(state_dir=tmp_path, engine="echo", model="echo", workers=1, services=("worker",)))
    assert argv_of(fixed)["worker-1"][:4] == ["--engine", "echo", "--model", "echo"]
