"""``/tokenize`` and ``/detokenize`` over HTTP, on a real nats-server with a sim worker and
the gateway as tasks in this process: the round trip, the counts against what a chat
completion bills, and OpenAI-shaped errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from bus import Bus, BusSettings
from services.gateway.service import GatewayService
from services.worker.service import WorkerService
from tests.gateway_mesh import MODEL, gateway_service, known_key, sim_worker


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    async with sim_worker(bus_settings) as service:
        yield service


@pytest.fixture
async def gateway(bus_settings: BusSettings, worker: WorkerService) -> AsyncIterator[GatewayService]:
    async with gateway_service(bus_settings) as service:
        yield service


@pytest.fixture
async def key(bus: Bus, gateway: GatewayService) -> str:
    return await known_key(bus, gateway, "tokenize-org")


async def post(url: str, key: str | None, payload: Any = None, data: bytes | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http, http.post(url, json=payload, data=data, headers=headers) as r:
        assert r.content_type == "application/json"
        return r.status, await r.json()


async def test_round_trip(gateway: GatewayService, key: str) -> None:
    text = "Grüße, mesh 🙂"
    status, tokens = await post(f"{gateway.http_url}/tokenize", key, {"model": MODEL, "prompt": text,
                                                                       "return_token_strs": True})
    assert status == 200, tokens
    assert tokens["count"] == len(tokens["tokens"]) == len(text.encode())  # the sim's byte tokenizer
    assert tokens["max_model_len"] == 2048 and len(tokens["token_strs"]) == tokens["count"]
    status, back = await post(f"{gateway.http_url}/detokenize", key, {"model": MODEL, "tokens": tokens["tokens"]})
    assert (status, back) == (200, {"prompt": text})
    # vLLM's servers take no model when they serve one: neither does a key that sees one
    status, again = await post(f"{gateway.http_url}/tokenize", key, {"prompt": text})
    assert status == 200 and again["tokens"] == tokens["tokens"]


async def test_chat_form_counts_what_a_chat_completion_bills(gateway: GatewayService, key: str) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "How warm is the cache?"}]
    tools: list[ChatCompletionToolParam] = [
        {"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}]
    status, counted = await post(f"{gateway.http_url}/tokenize", key, {"model": MODEL, "messages": messages,
                                                                        "tools": tools})
    assert status == 200, counted
    client = openai.AsyncOpenAI(base_url=f"{gateway.http_url}/v1", api_key=key, max_retries=0)
    reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                                 tool_choice="none", max_tokens=1)
    assert reply.usage is not None and reply.usage.prompt_tokens == counted["count"]
    status, plain = await post(f"{gateway.http_url}/tokenize", key, {"model": MODEL, "messages": messages})
    assert status == 200 and plain["count"] < counted["count"]  # the tools are in the prompt


@pytest.mark.parametrize(("path", "payload", "status", "code", "param"), [
    ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model_not_found", "model"),
    ("/detokenize", {"model": "no-such-model", "tokens": [3]}, 404, "model_not_found", "model"),
    ("/tokenize", {"model": MODEL}, 400, "missing_required_parameter", "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": 7}, 400, "invalid_type", "prompt"),
    ("/detokenize", {"model": MODEL, "tokens": [3, 10**6]}, 400, "invalid_value", "tokens"),
])
async def test_errors_are_openai_shaped(gateway: GatewayService, key: str, path: str, payload: Any, status: int,
                                        code: str, param: str) -> None:
    got, body = await post(f"{gateway.http_url}{path}", key, payload)
    assert got == status, body
    assert (body["error"]["code"], body["error"]["param"], body["error"]["type"]) == \
        (code, param, "invalid_request_error")


async def test_bad_json_no_key_and_wrong_method(gateway: GatewayService, key: str) -> None:
    status, body = await post(f"{gateway.http_url}/tokenize", key, data=b"{not json")
    assert (status, body["error"]["code"]) == (400, "invalid_json")
    status, body = await post(f"{gateway.http_url}/detokenize", None, {"model": MODEL, "tokens": [3]})
    assert (status, body["error"]["code"]) == (401, "missing_api_key")
    async with aiohttp.ClientSession() as http, http.get(f"{gateway.http_url}/tokenize") as r:
        assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
