"""LoRA adapters end to end (issue 21, part 1), on a real nats-server: ``meshserve adapters``
registers one of a served model (refusing what the pool could not serve), the gateway
lists it with its base and sends a request naming it to the base's pool with the adapter,
a sim worker loads it into a slot at run time, the router prices loads against queues,
and a removed or unknown adapter is a 404 like an unknown model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from bus import Bus, BusSettings
from bus.keys import AdapterStore
from ops.cli import main
from ops.keys import create_key
from proto import UsageEvent
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.engines.sim import SimEngine
from tests.conftest import eventually, usage_events
from tests.integration.test_router import MODEL, RouterFactory, WorkerFactory, start_router, start_worker

__all__ = ["start_router", "start_worker"]  # fixtures


def adapter_dir(root: Path, name: str, rank: int = 8, size: int = 2_000_000) -> Path:
    """A PEFT adapter directory: its config (rank) and weights (their size is what a load reads)."""
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16, "peft_type": "LORA",
                                                       "target_modules": ["q_proj", "v_proj"]}))
    (d / "adapter_model.safetensors").write_bytes(b"\0" * size)
    return d


async def adapters_cli(settings: BusSettings, *argv: str) -> int:
    return await asyncio.to_thread(main, ["adapters", "--nats-url", settings.servers[0], *argv])


async def test_an_adapter_is_added_listed_served_from_a_slot_and_removed(
    bus: Bus, bus_settings: BusSettings, start_worker: WorkerFactory, start_router: RouterFactory, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    worker = await start_worker("w1", max_loras=2, max_cpu_loras=4)
    plain = await start_worker("plain")  # loads no adapters: the router must never send one there
    router = await start_router("prefix")
    await eventually(lambda: router.stats()["placeable"] == 2, what="two placeable workers")
    gateway = GatewayService(GatewayConfig(port=0), bus_settings)
    await gateway.start()
    try:
        assert await adapters_cli(bus_settings, "list") == 0  # none yet: says so, and how to add one
        assert "no LoRA adapters in this mesh" in capsys.readouterr().out
        sql = adapter_dir(tmp_path, "sql")
        assert await adapters_cli(bus_settings, "add", "sql-writer", "--base", MODEL, "--path", str(sql)) == 0
        # refused, nothing stored: a rank above the pool's 16, a base nobody serves, a taken name, no config
        big = adapter_dir(tmp_path, "big", rank=64)
        assert await adapters_cli(bus_settings, "add", "big", "--base", MODEL, "--path", str(big)) == 2
        assert "rank is 64, above the 16" in capsys.readouterr().err
        assert await adapters_cli(bus_settings, "add", "x", "--base", "gpt-9", "--path", str(sql)) == 2
        assert "no worker serves model 'gpt-9'" in capsys.readouterr().err
        assert await adapters_cli(bus_settings, "add", "sql-writer", "--base", MODEL, "--path", str(sql)) == 2
        assert "exists" in capsys.readouterr().err
        assert await adapters_cli(bus_settings, "add", "y", "--base", MODEL, "--path", str(tmp_path)) == 2
        assert "no adapter_config.json" in capsys.readouterr().err
        empty = adapter_dir(tmp_path, "empty")
        (empty / "adapter_model.safetensors").write_bytes(b"")
        assert await adapters_cli(bus_settings, "add", "empty", "--base", MODEL, "--path", str(empty)) == 2
        assert "its weights file adapter_model.safetensors is empty" in capsys.readouterr().err
        for bad in ("sql:v2", "sql@1"):  # NATS KV keys refuse them: refused here, not as a NATS error
            assert await adapters_cli(bus_settings, "add", bad, "--base", MODEL, "--path", str(sql)) == 2
            assert "letters, digits and . _ / - only" in capsys.readouterr().err
        assert [a.name for a in await (await AdapterStore(bus).open()).list()] == ["sql-writer"]
        # served like a model: a key may be restricted to it, and its tokenizer (its base's) exported
        url = bus_settings.servers[0]
        assert await asyncio.to_thread(main, ["keys", "--nats-url", url, "create", "--org", "acme-sql",
                                              "--model", "sql-writer"]) == 0
        assert await asyncio.to_thread(main, ["tokenizer", "export", str(tmp_path / "tok"), "--model", "sql-writer",
                                              "--nats-url", url]) == 0
        assert (tmp_path / "tok" / "tokenizer.json").exists()
        capsys.readouterr()

        key, record = await create_key(bus, org="acme")
        await eventually(lambda: record.key_id in gateway.keys.records and "sql-writer" in gateway.adapters.records,
                         what="the gateway to see the key and the adapter")
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.bound_port}/v1", api_key=key, max_retries=0)
        models = {m.id: m for m in (await client.models.list()).data}
        card = models["sql-writer"].model_dump()
        assert (card["parent"], card["root"]) == (MODEL, str(sql.resolve()))
        # a base model's card too, as vLLM's: its parent null (how clients tell the base models)
        assert (models[MODEL].model_dump()["parent"], models[MODEL].model_dump()["root"]) == (None, MODEL)
        for i in range(4):
            done = await client.completions.create(model="sql-writer", prompt=f"select {i} from t", max_tokens=5,
                                                   extra_body={"ignore_eos": True})
            assert done.model == "sql-writer" and done.usage is not None and done.usage.completion_tokens == 5
        assert router.stats()["placements_by_worker"] == {"w1": 4}  # never the worker that cannot load it
        assert worker.engine.stats().lora_adapters == ["sql-writer"]  # resident in a slot
        assert isinstance(worker.engine, SimEngine)
        assert worker.engine.core.lora.loads_from_disk == 1  # loaded once, then served from its slot
        assert plain.engine.stats().lora_adapters == []
        # billed as the client named it (vLLM reports the adapter's name), with its base for the price
        billed: list[UsageEvent] = []
        for _ in range(100):
            billed = [e for e in await usage_events(bus) if e.org == "acme"]
            if len(billed) == 4:
                break
            await asyncio.sleep(0.1)
        assert {(e.model, e.base_model) for e in billed} == {("sql-writer", MODEL)} and len(billed) == 4
        # A key restricted to the base model is not given its adapters (a team's fine-tune).
        base_key, base_record = await create_key(bus, org="acme-other", models=[MODEL])
        await eventually(lambda: base_record.key_id in gateway.keys.records, what="the gateway to see the key")
        base_client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.bound_port}/v1", api_key=base_key,
                                         max_retries=0)
        assert [m.id for m in (await base_client.models.list()).data] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            await base_client.completions.create(model="sql-writer", prompt="x", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await base_client.models.retrieve("sql-writer")

        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="sql-reader", prompt="x", max_tokens=2)
        assert await adapters_cli(bus_settings, "remove", "sql-writer") == 0
        await eventually(lambda: "sql-writer" not in gateway.adapters.records, what="the gateway to drop it")
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="sql-writer", prompt="x", max_tokens=2)
        assert await adapters_cli(bus_settings, "remove", "sql-writer") == 1
    finally:
        await gateway.drain_and_close()


async def test_a_pool_that_loads_no_adapters_refuses_them_at_add(
    bus_settings: BusSettings, start_worker: WorkerFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    await start_worker("static")
    await asyncio.sleep(0.2)
    d = adapter_dir(tmp_path, "a")
    assert await adapters_cli(bus_settings, "add", "a", "--base", MODEL, "--path", str(d)) == 2
    assert "do not load adapters at run time: start them with --max-loras N" in capsys.readouterr().err
