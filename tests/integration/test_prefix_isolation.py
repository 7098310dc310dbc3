"""A prefix one org's requests cached is found by that org's requests only (as OpenAI's
prompt caching is per organization). Shared across orgs, a request's ``cached_tokens``
(and its TTFT) told one tenant whether another had sent the same text: a guessed secret
in a prompt read as 224 cached tokens where the wrong guesses read 112-128."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from openai import AsyncOpenAI

from bus import Bus, BusSettings
from proto import block_hashes, prefix_salt
from services.gateway.service import GatewayService
from services.worker.service import WorkerService
from tests.gateway_mesh import MODEL, gateway_service, known_key, sim_worker

PROMPT = "The meeting is on May 12. " * 40  # ~1,000 tokens of the byte tokenizer: many full blocks


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    async with sim_worker(bus_settings, speed=50.0, max_model_len=4096) as service:
        yield service


@pytest.fixture
async def gateway(bus_settings: BusSettings, worker: WorkerService) -> AsyncIterator[GatewayService]:
    async with gateway_service(bus_settings) as service:
        yield service


async def cached_tokens(gateway: GatewayService, key: str, cache_salt: str | None = None) -> int:
    client = AsyncOpenAI(base_url=f"{gateway.http_url}/v1", api_key=key, max_retries=0)
    extra = {"cache_salt": cache_salt} if cache_salt is not None else None
    reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=2, extra_body=extra)
    await client.close()
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


async def test_an_orgs_cached_prefix_is_its_own(bus: Bus, gateway: GatewayService) -> None:
    first, second = await known_key(bus, gateway, "org-a"), await known_key(bus, gateway, "org-a")
    other = await known_key(bus, gateway, "org-b")
    assert await cached_tokens(gateway, first) == 0
    shared = await cached_tokens(gateway, second)
    assert shared > 900  # the same org: the whole prompt but its last block
    assert await cached_tokens(gateway, other) == 0  # another org: nothing, though the blocks are held
    assert await cached_tokens(gateway, other) == shared  # and its own copy is found next time


def test_the_salt_is_the_adapter_and_the_org() -> None:
    tokens = list(range(64))
    assert prefix_salt(None) == prefix_salt(None, "") == ""  # no org: the hashes as before
    assert prefix_salt("sql") == "sql"
    hashes = {salt: block_hashes(tokens, 16, salt)[0] for salt in
              (prefix_salt(None, "a"), prefix_salt(None, "b"), prefix_salt("sql", "a"), prefix_salt("sql"), "")}
    assert len(set(hashes.values())) == 5


async def test_a_cache_salt_keeps_prefixes_to_the_requests_that_give_it(bus: Bus, gateway: GatewayService) -> None:
    """vLLM's ``cache_salt``: a service holding one key for many end users keeps each
    user's prefixes to that user (it was refused; before that, dropped)."""
    key = await known_key(bus, gateway, "org-s")
    assert await cached_tokens(gateway, key, "user-1") == 0
    assert await cached_tokens(gateway, key, "user-2") == 0  # another salt: nothing, though the blocks are held
    assert await cached_tokens(gateway, key) == 0  # no salt: the org's own, apart from every salt
    assert await cached_tokens(gateway, key, "user-1") > 900  # the same salt: found


async def test_the_responses_api_carries_the_cache_salt(bus: Bus, gateway: GatewayService) -> None:
    """``/v1/responses`` dropped ``cache_salt`` (review): the isolation asked for did not apply."""
    key = await known_key(bus, gateway, "org-r")
    client = AsyncOpenAI(base_url=f"{gateway.http_url}/v1", api_key=key, max_retries=0)

    async def cached(salt: str) -> int:
        reply = await client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2, store=False,
                                              extra_body={"cache_salt": salt})
        assert reply.usage is not None
        return reply.usage.input_tokens_details.cached_tokens

    assert await cached("user-1") == 0
    assert await cached("user-2") == 0  # another salt: nothing
    assert await cached("user-1") > 900
    with pytest.raises(openai.BadRequestError) as bad:
        await cached("")
    assert bad.value.body["param"] == "cache_salt"  # type: ignore[index]
    await client.close()
