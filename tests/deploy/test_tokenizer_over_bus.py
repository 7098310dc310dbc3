"""A gateway on a host without the model's files tokenizes with the tokenizer its workers
stored on the bus (bus.tokenizers), each service as its own NATS user.

In a cluster the weights (and the tokenizer beside them) are on the GPU hosts only: a
vLLM worker's hub download, a Nomad host volume. Here the worker's directory is moved
away once the worker has started, so the gateway cannot read the path it registered.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import openai
import pytest

from bus import Bus
from ops.keys import create_key
from ops.tiny_model import build_tokenizer_json, tokenizer_config
from services.common.tokenizer import HFTokenizer
from services.gateway.service import GatewayConfig, GatewayService
from services.worker.engines.echo import EchoEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.deploy.natsauth import AuthNatsServer, settings_for

PROMPT = "Is the cache warm? hello world"


async def test_a_gateway_without_the_models_files_fetches_its_tokenizer(
    auth_server: AuthNatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "gpu-host" / "tiny"
    model_dir.mkdir(parents=True)
    (model_dir / "tokenizer.json").write_text(build_tokenizer_json(512, 0))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(4096)))
    expected = HFTokenizer(model_dir)
    prompt_ids = expected.encode(PROMPT)
    assert len(prompt_ids) < len(PROMPT.encode())  # tells it apart from the byte tokenizer

    worker = WorkerService(EchoEngine(model="tiny", tokenizer=str(model_dir), tokens_per_s=2000),
                           WorkerConfig(worker_id="w1"), settings_for(auth_server, "worker"))
    await worker.start()
    gateway: GatewayService | None = None
    ops = await Bus.open(settings_for(auth_server, "ops"), "ops-test", initial_attempts=20)
    try:
        assert worker.registration is not None and worker.registration.info is not None
        digest = worker.registration.info.tokenizer_digest
        assert len(digest) == 64
        shutil.move(model_dir, tmp_path / "elsewhere")  # the gateway's host has no such path
        cache = tmp_path / "gateway-cache"
        monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(cache))
        gateway = GatewayService(GatewayConfig(port=0, gateway_id="gw-1"), settings_for(auth_server, "gateway"))
        await gateway.start()
        # Fetched before the gateway took requests, into its cache.
        assert (cache / "tokenizers" / digest / "tokenizer.json").is_file()
        assert "tiny" in gateway.models.specs()

        key, _ = await create_key(ops, org="acme", tier="premium")
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.bound_port}/v1", api_key=key, max_retries=0)
        for _ in range(200):
            try:
                answer = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
                break
            except openai.AuthenticationError:  # the key watcher has not seen the new key yet
                await asyncio.sleep(0.05)
        else:
            pytest.fail("the gateway never accepted the new key")
        usage = answer.usage
        assert usage is not None and usage.prompt_tokens == len(prompt_ids)
        # The echo engine streams the prompt's own tokens back: decoded with the same tokenizer.
        assert answer.choices[0].text == expected.decode(prompt_ids[:4])
        await client.close()
        assert auth_server.violations() == []
    finally:
        if gateway is not None:
            await gateway.drain_and_close()
        await worker.drain_and_close()
        await ops.close()
