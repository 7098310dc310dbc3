"""The router's config file: default policy, per-model policies, aliases, cascades."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.router.config import RouterServiceConfig, load_config, parse_config
from services.router.main import add_arguments, build_config

TOML = """
policy = "least_load"
[default]
beta = 0.25
[models."big/model"]
policy = "session"
session_vnodes = 16
[models.small]
policy = "round_robin"
[aliases]
fast = "small"
[cascades.auto]
small = "small"
large = "big/model"
max_prompt_tokens = 512
hard_keywords = ["prove"]
hard_keyword_tokens = [[1, 2, 3]]
[view]
stale_after_s = 5
[service]
forward_timeout_s = 1.5
"""


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(TOML)
    cfg = load_config(path)
    r = cfg.router
    assert r.default.policy == "least_load" and r.default.beta == 0.25
    big = r.for_model("big/model")
    assert (big.policy, big.session_vnodes, big.beta) == ("session", 16, 0.25)  # inherits the default's fields
    assert r.for_model("small").policy == "round_robin"
    assert r.for_model("other").policy == "least_load"
    assert r.aliases == {"fast": "small"}
    auto = r.cascades["auto"]
    assert auto.hard_keywords == ("prove",) and auto.hard_keyword_tokens == ((1, 2, 3),) and auto.max_prompt_tokens == 512
    assert cfg.view.stale_after_s == 5 and cfg.forward_timeout_s == 1.5


def test_cli_policy_overrides_the_file_default(tmp_path: Path) -> None:
    path = tmp_path / "router.json"
    path.write_text('{"policy": "session", "models": {"m": "least_load"}}')
    cfg = load_config(path, policy="prefix", metrics_port=None)
    assert cfg.router.default.policy == "prefix"
    assert cfg.router.for_model("m").policy == "least_load"  # a per-model choice stays
    assert cfg.metrics_port is None


def test_no_file_defaults_to_prefix() -> None:
    assert parse_config({}).router.default.policy == "prefix"


@pytest.mark.parametrize(
    "raw",
    [
        {"polcy": "prefix"},
        {"policy": "fastest"},
        {"models": {"m": {"policy": "prefix", "bogus": 1}}},
        {"cascades": {"c": {"small": "a"}}},  # large missing
        {"view": {"stale": 1}},
        {"service": {"router": {}}},
        {"view": 5},  # a section that is not a table
        {"models": {"m": {"d": 0}}},  # a model's invalid setting
    ],
)
def test_bad_configs_are_refused_with_a_message(raw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        parse_config(raw)


def test_cli_arguments(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--policy", "round_robin", "--metrics-port", "0", "--forward-timeout", "0.5"])
    cfg = build_config(args)
    assert cfg.router.default.policy == "round_robin" and cfg.metrics_port == 0 and cfg.forward_timeout_s == 0.5
    # options not given leave the config's defaults (the file's, else the dataclass's)
    defaults = RouterServiceConfig()
    cfg = build_config(parser.parse_args([]))
    assert (cfg.forward_timeout_s, cfg.metrics_host, cfg.seed) == (defaults.forward_timeout_s, defaults.metrics_host, None)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="expected an object of sections"):
        build_config(parser.parse_args(["--config", str(listed)]))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit):
        build_config(parser.parse_args(["--config", str(bad)]))


def test_cascade_keywords_are_tokenized_once_the_pool_tokenizer_is_known() -> None:
    from proto.hashing import pack_tokens
    from proto.workers import WorkerInfo
    from services.common.tokenizer import load_tokenizer
    from services.router.policy import RouteQuery
    from services.router.service import RouterService

    cfg = parse_config({"cascades": {"auto": {"small": "s", "large": "l", "hard_keywords": ["prove"]}}})
    service = RouterService(cfg)
    query = RouteQuery.of("r", "auto", pack_tokens(load_tokenizer("byte").encode("please prove it")), max_tokens=8)
    assert service.router.resolve(query)[0] == ["s", "l"]  # no token ids yet: looks easy
    service._on_registry("w1", WorkerInfo(worker_id="w1", model="s", engine="sim", tokenizer="byte", state="ready"))
    assert service.router.config.cascades["auto"].hard_keyword_tokens
    models, why = service.router.resolve(query)
    assert models[0] == "l" and "keyword" in why
