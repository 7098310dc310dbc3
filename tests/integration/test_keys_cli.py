"""``meshserve keys`` against a real nats-server: create refuses what the mesh cannot honour
(exit 2, one line, nothing stored), revoke takes a whole key, list shows broken records;
and every command without a reachable mesh says so in one line, no traceback."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus import Bus, BusSettings
from bus.keys import KeyStore
from ops.cli import main
from ops.natsserver import free_port
from proto import ApiKeyRecord, WorkerInfo, encode
from services.gateway.apikeys import generate_key

ROOT = Path(__file__).resolve().parents[2]


def meshserve(nats_url: str, *argv: str) -> int:
    return main(["keys", "--nats-url", nats_url, *argv])


def stored(nats_url: str) -> list[ApiKeyRecord]:
    async def read() -> list[ApiKeyRecord]:
        bus = await Bus.open(BusSettings(servers=(nats_url,)), "test-keys")
        try:
            return await (await KeyStore(bus).open()).list()
        finally:
            await bus.close()

    return asyncio.run(read())


def put_raw(nats_url: str, key_id: str, value: bytes) -> None:
    async def put() -> None:
        bus = await Bus.open(BusSettings(servers=(nats_url,)), "test-keys")
        try:
            await (await KeyStore(bus).open()).kv.put(key_id, value)
        finally:
            await bus.close()

    asyncio.run(put())


def register_worker(nats_url: str, model: str) -> None:
    async def put() -> None:
        from bus.provision import workers_bucket

        bus = await Bus.open(BusSettings(servers=(nats_url,)), "test-keys")
        try:
            kv = await workers_bucket(bus.js, bus.subjects)
            await kv.put("w1", encode(WorkerInfo(worker_id="w1", model=model, engine="sim", state="ready",
                                                  heartbeat_at=time.time())))
        finally:
            await bus.close()

    asyncio.run(put())


@pytest.mark.parametrize(("argv", "says"), [
    (["--rpm", "-5"], "--rpm must be a whole number ≥ 1, got -5"),
    (["--tpm", "0"], "--tpm must be a whole number ≥ 1, got 0"),
    (["--max-concurrent", "0"], "--max-concurrent must be a whole number ≥ 1, got 0"),
    (["--rpm", "100000000000000000000"], "--rpm must be at most 9,223,372,036,854,775,807"),  # msgpack's OverflowError
    (["--tier", "gold"], "unknown tier 'gold': admission's tiers are premium, standard, batch"),
    (["--model", "does-not-exist"], "no worker serves model 'does-not-exist' (served now: none"),
])
def test_create_refuses_what_the_mesh_cannot_honour(
    nats_url: str, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert meshserve(nats_url, "create", "--org", "acme", *argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"meshserve keys create: {says}") and captured.err.count("\n") == 1
    assert captured.out == ""
    assert stored(nats_url) == []


def test_create_checks_models_against_the_registry_and_tiers_against_admissions_config(
    nats_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    register_worker(nats_url, "sim-llama-8b")
    assert meshserve(nats_url, "create", "--org", "acme", "--model", "sim-llama-8b", "--model", "llama") == 2
    assert "no worker serves model 'llama' (served now: sim-llama-8b)" in capsys.readouterr().err
    assert meshserve(nats_url, "create", "--org", "acme", "--model", "sim-llama-8b", "--model", "llama",
                     "--allow-unknown-model") == 0
    config = tmp_path / "admission.toml"
    config.write_text('default_tier = "gold"\n[tiers.gold]\nttft_slo_s = 1.0\npriority = 1\n')
    assert meshserve(nats_url, "create", "--org", "acme", "--tier", "gold", "--admission-config", str(config)) == 0
    assert [(r.tier, r.models) for r in stored(nats_url)] == [("standard", ["sim-llama-8b", "llama"]), ("gold", [])]


def test_revoke_takes_a_whole_key_and_list_shows_broken_records(
    nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert meshserve(nats_url, "list") == 0  # no keys yet: says so and how to make one, not an empty table
    assert "no API keys in this mesh" in capsys.readouterr().out
    assert meshserve(nats_url, "list", "--json") == 0
    assert json.loads(capsys.readouterr().out) == []
    assert meshserve(nats_url, "create", "--org", "acme", "--rpm", "60", "--max-concurrent", "4") == 0
    key = capsys.readouterr().out.strip()
    assert [r.max_concurrent for r in stored(nats_url)] == [4]
    assert key.startswith("msk-")
    assert meshserve(nats_url, "revoke", key) == 0
    assert [r.revoked for r in stored(nats_url)] == [True]
    assert key not in capsys.readouterr().out  # the secret is never echoed
    assert meshserve(nats_url, "revoke", "msk-nope") == 2
    err = capsys.readouterr().err
    assert err.startswith("meshserve keys revoke: ") and "nope" not in err
    assert meshserve(nats_url, "revoke", "0123456789ab") == 1
    assert capsys.readouterr().err == "meshserve keys revoke: no key 0123456789ab\n"

    _, bad = generate_key(org="acme", rpm=-5)
    put_raw(nats_url, bad.key_id, encode(bad))
    put_raw(nats_url, "00000000000f", b"\x00not a record")
    assert meshserve(nats_url, "list", "--json") == 0
    rows = {row["key_id"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows[bad.key_id]["problem"] == "invalid limit rpm -5: recreate the key"
    assert rows["00000000000f"]["problem"] == "unreadable record"
    assert all("key_hash" not in row for row in rows.values())
    assert meshserve(nats_url, "list") == 0
    out = capsys.readouterr().out
    assert bad.key_id in out and "invalid limit rpm -5" in out and "unreadable record" in out


def test_every_command_without_a_mesh_says_so_in_one_line() -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    commands = [["keys", "--nats-url", url, "list"], ["status", "--nats-url", url], ["usage", "--nats-url", url],
                ["services", "--nats-url", url], ["adapters", "--nats-url", url, "list"]]
    with socket.socket() as silent:  # takes connections (the kernel's backlog) and never speaks NATS
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        silent_url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        commands.append(["status", "--nats-url", silent_url])
        procs = [subprocess.Popen([sys.executable, "-m", "ops.cli", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for argv in commands]
        results = [proc.communicate(timeout=120) for proc in procs]
    for argv, proc, (out, err) in zip(commands, procs, results, strict=True):
        name = f"{argv[0]} list" if argv[0] in ("keys", "adapters") else argv[0]
        assert proc.returncode == 1, err
        assert out == "" and err.count("\n") == 1, err
        assert "is the mesh up?" in err and "--nats-url" in err
        if silent_url in argv:
            assert err.startswith(f"meshserve {name}: cannot reach NATS at {silent_url}: it takes connections "
                                  "but did not answer as a NATS server in time"), err
        else:  # said at once, not after the client's connect timeout as "TimeoutError()"
            assert err.startswith(f"meshserve {name}: cannot reach NATS at {url}: connection refused, "
                                  "nothing listens there"), err


def test_a_name_that_does_not_resolve_is_named() -> None:
    from ops.console import unreachable_servers

    found = asyncio.run(unreachable_servers(["nats://no-such-host.invalid:4222"], timeout_s=5.0))
    assert len(found) == 1 and found[0].startswith("nats://no-such-host.invalid:4222: "), found
    assert "refused" not in found[0]
