"""Anthropic's ``/v1/messages`` over HTTP with the stock ``anthropic`` client: plain and
streamed messages (the SDK's own stream accumulator rebuilds them), system prompts and
stop sequences, forced tool calls and their results, structured output, thinking,
``count_tokens``, and errors in Anthropic's shape. A sim worker and the gateway run as
tasks in this process, on a real nats-server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import pytest

from bus import Bus, BusSettings
from services.gateway.service import GatewayService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.conftest import final_chunks
from tests.gateway_mesh import MODEL, gateway_service, known_key, sim_worker

WEATHER: Any = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    async with sim_worker(bus_settings, speed=50.0, max_model_len=4096) as service:
        yield service


@pytest.fixture
async def gateway(bus_settings: BusSettings, worker: WorkerService) -> AsyncIterator[GatewayService]:
    async with gateway_service(bus_settings) as service:
        yield service


@pytest.fixture
async def client(bus: Bus, gateway: GatewayService) -> AsyncIterator[anthropic.AsyncAnthropic]:
    key = await known_key(bus, gateway, "org-a")
    async with anthropic.AsyncAnthropic(base_url=gateway.http_url, api_key=key, max_retries=0) as made:
        yield made


async def test_a_message_plain_and_streamed(client: anthropic.AsyncAnthropic) -> None:
    message = await client.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Hi"}],
                                           extra_body={"ignore_eos": True})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert [block.type for block in message.content] == ["text"] and message.content[0].text  # type: ignore[union-attr]
    assert message.usage.output_tokens == 12 and message.usage.input_tokens > 0
    assert message.usage.cache_read_input_tokens is not None

    # The SDK's stream helper checks the events' order and rebuilds the message from them.
    async with client.messages.stream(model=MODEL, max_tokens=40, system="Be brief.",
                                      messages=[{"role": "user", "content": "Count."}]) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert texts and final.content[0].text == "".join(texts)  # type: ignore[union-attr]
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 0

    raw = await client.messages.create(model=MODEL, max_tokens=8, stream=True,
                                       messages=[{"role": "user", "content": "Again."}], extra_body={"ignore_eos": True})
    kinds = [event.type async for event in raw]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1


async def test_a_conversation_with_a_system_prompt_and_stop_sequences(client: anthropic.AsyncAnthropic,
                                                                      gateway: GatewayService) -> None:
    conversation: list[Any] = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello Ada."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is my name?", "cache_control": {"type": "ephemeral"}}]},
    ]
    system: list[Any] = [{"type": "text", "text": "You are terse."}]
    short = await client.messages.create(model=MODEL, max_tokens=4, messages=conversation[-1:])
    long = await client.messages.create(model=MODEL, max_tokens=4, messages=conversation, system=system)
    total = long.usage.input_tokens + (long.usage.cache_read_input_tokens or 0)
    assert total > short.usage.input_tokens + (short.usage.cache_read_input_tokens or 0)
    # count_tokens counts the prompt the same request takes.
    counted = await client.messages.count_tokens(model=MODEL, messages=conversation, system=system)
    assert counted.input_tokens == total

    # A stop sequence: the sim spells what guided decoding asks, so the stop is certain.
    stopped = await client.messages.create(model=MODEL, max_tokens=30, stop_sequences=["STOP"],
                                           messages=[{"role": "user", "content": "Say it."}],
                                           extra_body={"guided_regex": "abc STOP def"})
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "STOP", stopped
    assert stopped.content[0].text == "abc "  # type: ignore[union-attr]
    async with client.messages.stream(model=MODEL, max_tokens=30, stop_sequences=["STOP"],
                                      messages=[{"role": "user", "content": "Say it."}],
                                      extra_body={"guided_regex": "abc STOP def"}) as stream:
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == "STOP"
    assert streamed.content[0].text == "abc "  # type: ignore[union-attr]


async def test_a_forced_tool_call_and_its_result(client: anthropic.AsyncAnthropic) -> None:
    ask: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    message = await client.messages.create(model=MODEL, max_tokens=300, messages=ask, tools=[WEATHER],  # type: ignore[list-item]
                                           tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(calls[0].input["city"], str)  # type: ignore[index]

    partial: dict[int, str] = {}
    async with client.messages.stream(model=MODEL, max_tokens=300, messages=ask, tools=[WEATHER],  # type: ignore[list-item]
                                      tool_choice={"type": "any"}) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial[event.index] = partial.get(event.index, "") + event.delta.partial_json
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content  # "any": one call or several, each a block
    streamed_calls: list[Any] = list(streamed.content)
    for index, call in enumerate(streamed_calls):
        assert call.type == "tool_use" and call.name == "get_weather" and call.id
        assert json.loads(partial[index]) == call.input and isinstance(call.input["city"], str)

    # The client runs the tool and sends its result back, as the Messages API has it.
    # (tool_choice none: the sim's model has no tool-call parser, which auto needs.)
    answer = await client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], tool_choice={"type": "none"}, messages=[
        *ask, {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                  "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"},
                                     {"type": "text", "text": "And tomorrow?"}]}])
    assert answer.content[0].type == "text" and answer.usage.output_tokens > 0


async def test_structured_output(client: anthropic.AsyncAnthropic) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    message = await client.messages.create(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "A city."}],
                                           extra_body={"output_config": {"format": {"type": "json_schema",
                                                                                    "schema": schema}}})
    data = json.loads(message.content[0].text)  # type: ignore[union-attr]
    assert set(data) == {"city", "population"} and isinstance(data["population"], int)


async def test_thinking_comes_as_its_block(bus_settings: BusSettings, client: anthropic.AsyncAnthropic) -> None:
    """A model whose worker names the ``think`` reasoning parser: its reasoning is a
    thinking block with a signature, streamed as thinking deltas (guided decoding makes the
    sim spell the tags); ``thinking: disabled`` turns the parser's split off."""
    worker = WorkerService(SimEngine(model="sim-think", speed=50.0), WorkerConfig(worker_id="w2", reasoning_parser="think"),
                           bus_settings)
    await worker.start()
    try:
        for _ in range(100):
            if "sim-think" in [m.id async for m in client.models.list()]:
                break
            await asyncio.sleep(0.1)
        shape = {"guided_regex": r"<think>[a-z]{4,12}</think>[A-Z][a-z]{3,12}"}
        ask: list[Any] = [{"role": "user", "content": "Think, then answer."}]
        message = await client.messages.create(model="sim-think", max_tokens=60, messages=ask, extra_body=shape)
        assert [block.type for block in message.content] == ["thinking", "text"]
        thinking = message.content[0]
        assert thinking.type == "thinking" and thinking.thinking.islower() and thinking.signature
        assert message.content[1].text.istitle()  # type: ignore[union-attr]
        async with client.messages.stream(model="sim-think", max_tokens=60, messages=ask, extra_body=shape,
                                          thinking={"type": "adaptive"}) as stream:  # type: ignore[arg-type,typeddict-item]
            deltas = [event.thinking async for event in stream if event.type == "thinking"]
            final = await stream.get_final_message()
        assert [block.type for block in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == "".join(deltas) and final.content[0].signature  # type: ignore[union-attr]
        # The thinking goes back in the next turn, as clients hand it back: accepted, not rendered.
        handed_back: list[Any] = [*ask, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
                                  {"role": "user", "content": "Go on."}]
        again = await client.messages.create(model="sim-think", max_tokens=60, extra_body=shape, messages=handed_back)
        assert again.content[-1].type == "text"
        off = await client.messages.create(model="sim-think", max_tokens=60, messages=ask, extra_body=shape,
                                           thinking={"type": "disabled"})
        assert [block.type for block in off.content] == ["text"] and off.content[0].text.startswith("<think>")  # type: ignore[union-attr]
    finally:
        await worker.drain_and_close()


async def _error(call: asyncio.Future[object] | object, kind: type[anthropic.APIStatusError]) -> dict[str, object]:
    with pytest.raises(kind) as caught:
        await call  # type: ignore[misc]
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error" and set(body["error"]) == {"type", "message"}  # type: ignore[arg-type]
    return body["error"]  # type: ignore[return-value]


async def test_errors_are_anthropic_shaped_and_name_the_field(client: anthropic.AsyncAnthropic,
                                                              gateway: GatewayService) -> None:
    hi: list[Any] = [{"role": "user", "content": "Hi"}]
    error = await _error(client.messages.create(model=MODEL, max_tokens=5000, messages=hi), anthropic.BadRequestError)
    # Anthropic's words, which Claude Code reads to lower max_tokens or compact the conversation.
    assert error["type"] == "invalid_request_error" and str(error["message"]).startswith(
        "input length and `max_tokens` exceed context limit: ") and "> 4096" in str(error["message"])
    error = await _error(client.messages.create(model="no-such-model", max_tokens=4, messages=hi),
                         anthropic.NotFoundError)
    assert error["type"] == "not_found_error"
    image: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    error = await _error(client.messages.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]), anthropic.BadRequestError)  # type: ignore[list-item]
    assert str(error["message"]).startswith("messages.0.content.1.type: ")
    error = await _error(client.messages.create(model=MODEL, max_tokens=2000, messages=hi,
                                                thinking={"type": "enabled", "budget_tokens": 1024}),
                         anthropic.BadRequestError)
    assert str(error["message"]).startswith("thinking.type: ")
    error = await _error(client.messages.create(model=MODEL, max_tokens=4, messages=hi, tools=[
        {"type": "web_search_20250305", "name": "web_search"}]), anthropic.BadRequestError)  # type: ignore[list-item]
    assert str(error["message"]).startswith("tools.0.type: ")
    error = await _error(client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": ""}],
                                                extra_body={"temperature": -1}), anthropic.BadRequestError)
    assert str(error["message"]).startswith("temperature: ")
    error = await _error(client.messages.create(model=MODEL, max_tokens=4, messages=hi, tools=[WEATHER],  # type: ignore[list-item]
                                                tool_choice={"type": "tool", "name": "nope"}), anthropic.BadRequestError)
    assert str(error["message"]).startswith("tool_choice.name: ")
    error = await _error(client.messages.count_tokens(model="no-such-model", messages=hi), anthropic.NotFoundError)
    assert error["type"] == "not_found_error"
    async with aiohttp.ClientSession() as http:
        url = f"{gateway.http_url}/v1/messages"
        headers = {"x-api-key": client.api_key or "", "anthropic-version": "2023-06-01"}
        async with http.post(url, json={"model": MODEL, "messages": hi}, headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["message"] == "max_tokens: Field required."
        async with http.post(url, data=b"{nope", headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with http.post(url, json={"model": MODEL, "max_tokens": 4, "messages": hi}) as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        huge = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (gateway.config.max_body_bytes + 1)}]}
        async with http.post(url, json=huge, headers=headers) as r:
            assert r.status == 413 and (await r.json())["error"]["type"] == "request_too_large"
        async with http.get(url, headers=headers) as r:
            assert r.status == 405 and (await r.json())["type"] == "error"
        async with http.post(f"{gateway.http_url}/v1/messages/nope", headers=headers) as r:
            assert r.status == 404 and (await r.json())["type"] == "error"  # under /v1/messages: Anthropic's
        async with http.post(f"{gateway.http_url}/v1/messagesx", headers=headers) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_url"  # not: OpenAI's
        # The OpenAI routes still answer OpenAI's shape.
        async with http.post(f"{gateway.http_url}/v1/chat/completions", json={"model": MODEL}, headers=headers) as r:
            assert r.status == 400 and "param" in (await r.json())["error"]


async def test_a_client_that_leaves_mid_stream_cancels_its_request(bus: Bus, bus_settings: BusSettings,
                                                                    client: anthropic.AsyncAnthropic,
                                                                    gateway: GatewayService) -> None:
    """No hung stream and no generation for nobody: the worker's request ends as aborted,
    long before its max_tokens (a real-time sim worker: 3000 tokens would take ~20 s)."""
    worker = WorkerService(SimEngine(model="sim-slow", speed=1.0, max_model_len=4096), WorkerConfig(worker_id="w3"),
                           bus_settings)
    await worker.start()
    try:
        for _ in range(100):
            if "sim-slow" in [m.id async for m in client.models.list()]:
                break
            await asyncio.sleep(0.1)
        finals = await final_chunks(bus, bus.subjects.tokens_all)
        body = {"model": "sim-slow", "max_tokens": 3000, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Go on and on."}]}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{gateway.http_url}/v1/messages", json=body,
                                 headers={"x-api-key": client.api_key or ""}) as r:
                request_id = r.headers["X-Request-Id"]
                async for line in r.content:
                    if b"content_block_delta" in line:
                        break  # tokens are flowing: leave
        for _ in range(300):
            if request_id in finals:
                break
            await asyncio.sleep(0.05)
        final = finals.get(request_id)
        assert final is not None and final.finish_reason == "abort"
        assert final.usage is not None and final.usage.completion_tokens < 3000
    finally:
        await worker.drain_and_close()
