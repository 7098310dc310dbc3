"""``bus.RunOptions``: a service process's settings from ``meshserve serve``'s common
options over the environment, handed to the service, never written to ``os.environ``."""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import pytest

from bus import BusSettings, RunOptions
from ops.cli import build_parser
from ops.serve import _runner

ENV = {"MESHSERVE_NATS_URL": "nats://env:4222", "MESHSERVE_ROOT": "envroot", "MESHSERVE_NATS_USER": "u"}


def test_options_given_override_the_environment() -> None:
    args = argparse.Namespace(nats_url="nats://a:1, nats://b:2", root="r2", log_level="DEBUG", log_format="json")
    options = RunOptions.from_args(args, ENV)
    assert options.settings.servers == ("nats://a:1", "nats://b:2") and options.settings.root == "r2"
    assert options.settings.user == "u"  # what the command line does not set still comes from the environment
    assert (options.log_level, options.log_format) == ("DEBUG", "json")


def test_without_options_the_environment_decides() -> None:
    options = RunOptions.from_args(argparse.Namespace(), ENV)
    assert options.settings == BusSettings.from_env(ENV)
    assert (options.log_level, options.log_format) == (None, None)


def test_child_env_carries_the_options_to_a_started_process() -> None:
    options = RunOptions(BusSettings(servers=("nats://a:1", "nats://b:2"), root="r2"), log_level="DEBUG")
    env = options.child_env({"PATH": "/bin", "MESHSERVE_NATS_URL": "nats://old:1"})
    assert env == {"PATH": "/bin", "MESHSERVE_NATS_URL": "nats://a:1,nats://b:2", "MESHSERVE_ROOT": "r2",
                   "MESHSERVE_LOG_LEVEL": "DEBUG"}


@pytest.mark.parametrize("service", ["router", "admission", "worker", "metering", "autoscaler"])
def test_serve_hands_the_common_options_over_in_args_not_the_environment(
    service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("NATS_URL", "ROOT", "LOG_LEVEL", "LOG_FORMAT"):
        monkeypatch.delenv(f"MESHSERVE_{name}", raising=False)
    args = build_parser("serve").parse_args(
        ["serve", service, "--nats-url", "nats://a:1", "--root", "r2", "--log-level", "DEBUG", "--log-format", "json",
         *(["--pool", "m"] if service == "autoscaler" else [])]
    )
    seen: list[RunOptions] = []

    def run(args: argparse.Namespace) -> int:
        seen.append(RunOptions.from_args(args))
        return 0

    # the real main's module name (it decides how the options travel), a stand-in run
    module = SimpleNamespace(__name__=f"services.{service}.main", run=run)
    assert _runner(module)(args) == 0
    assert not {k for k in os.environ if k in ("MESHSERVE_NATS_URL", "MESHSERVE_ROOT", "MESHSERVE_LOG_LEVEL")}
    assert seen[0].settings.servers == ("nats://a:1",) and seen[0].settings.root == "r2"
    assert (seen[0].log_level, seen[0].log_format) == ("DEBUG", "json")
