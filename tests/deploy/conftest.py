"""Fixtures of the deployment tests: a real nats-server with meshserve's accounts config."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.nats.accounts import render_accounts
from tests.deploy.natsauth import API_CLIENTS, PASSWORDS, AuthNatsServer


@pytest.fixture
def auth_server(tmp_path: Path) -> Iterator[AuthNatsServer]:
    server = AuthNatsServer(
        store_dir=tmp_path / "nats-auth", log_file=tmp_path / "nats-auth.log",
        accounts=render_accounts("mesh", passwords=PASSWORDS, api_clients=API_CLIENTS),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
