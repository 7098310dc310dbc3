"""The gateway's one loader: GatewayConfig's defaults unless an option or the models file says otherwise."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.gateway.config import GatewayConfig, load_config
from services.gateway.main import add_arguments, build_config
from services.gateway.models import ModelLimits
from services.gateway.upstream import UpstreamConfig


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_no_options_give_the_dataclass_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHSERVE_DEV_KEY_FILE", raising=False)
    assert build_config(_args()) == GatewayConfig()


def test_options_override_their_fields() -> None:
    config = build_config(_args("--port", "0", "--stall-timeout", "1.5", "--trusted-proxy", "10.0.0.0/8",
                                "--admission-unreachable", "closed", "--resume-window", "5"))
    assert config.port == 0 and config.stall_timeout_s == 1.5 and config.resume_window_s == 5.0
    assert config.trusted_proxies == ("10.0.0.0/8",)
    assert config.upstream == UpstreamConfig(admission_unreachable="closed")
    assert config.max_in_flight == GatewayConfig().max_in_flight


def test_help_quotes_the_dataclass_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args("--help")
    assert f"(default {GatewayConfig().stall_timeout_s})" in " ".join(capsys.readouterr().out.split())


def test_models_file_sets_limits_and_aliases(tmp_path: Path) -> None:
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"limits": {"m": {"max_tokens_cap": 8}}, "aliases": {"a": "m"}}))
    config = load_config(path, port=0)
    assert config.model_limits == {"m": ModelLimits(max_tokens_cap=8)}
    assert config.aliases == {"a": "m"} and config.port == 0


@pytest.mark.parametrize("content", ['{"limits": {"m": {"max_tokens_cap": "many"}}}', '{"limitz": {}}', "[1]", "{"])
def test_a_bad_models_file_is_one_clear_line_and_exit_2(tmp_path: Path, content: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "models.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        build_config(_args("--models-config", str(path)))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "Traceback" not in err
