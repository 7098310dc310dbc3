"""``/v1/responses`` over HTTP with the stock ``openai`` client: create (plain and streamed), store +
``previous_response_id``, retrieve, delete, per-org isolation, structured output and tool
calls through the chat path. A sim worker and the gateway run as tasks in this process,
on a real nats-server (its JetStream KV holds the stored responses)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator

import aiohttp
import openai
import pydantic
import pytest
from openai.types.responses import (
    ResponseInputMessageItem,
    ResponseInputText,
    ResponseOutputMessage,
    ResponseOutputText,
)

from bus import Bus, BusSettings
from services.gateway.response_store import ResponseStore, StoredResponse, responses_bucket
from services.gateway.service import GatewayService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.gateway_mesh import MODEL, gateway_service, known_key, sim_worker


class City(pydantic.BaseModel):
    city: str
    population: int


@pytest.fixture
async def worker(bus_settings: BusSettings) -> AsyncIterator[WorkerService]:
    async with sim_worker(bus_settings, speed=50.0, max_model_len=4096) as service:
        yield service


@pytest.fixture
async def gateway(bus_settings: BusSettings, worker: WorkerService) -> AsyncIterator[GatewayService]:
    async with gateway_service(bus_settings) as service:
        yield service


async def _client(bus: Bus, gateway: GatewayService, org: str) -> openai.AsyncOpenAI:
    """A stock client with a new key of ``org``, once the gateway knows the key and the worker."""
    key = await known_key(bus, gateway, org)
    return openai.AsyncOpenAI(base_url=f"{gateway.http_url}/v1", api_key=key, max_retries=0)


@pytest.fixture
async def client(bus: Bus, gateway: GatewayService) -> AsyncIterator[openai.AsyncOpenAI]:
    async with await _client(bus, gateway, "org-a") as made:
        yield made


async def test_create_plain_and_streamed(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=12,
                                             extra_body={"ignore_eos": True})
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details is not None  # it ran to max_output_tokens
    assert response.output_text and response.output[0].type == "message" and response.output[0].id.startswith("msg_")
    assert response.usage is not None and response.usage.output_tokens == 12 and response.usage.input_tokens > 0

    stream = await client.responses.create(model=MODEL, input=[{"role": "user", "content": "Count."}], stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    done = [event.text for event in events if event.type == "response.output_text.done"]
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas and done == [deltas] and final.output_text == deltas and final.status == "completed"
    assert final.usage is not None and final.usage.output_tokens > 0
    # Stored (the default) before response.completed went out: retrievable at once, the same object.
    assert (await client.responses.retrieve(final.id)).model_dump() == final.model_dump()


async def test_previous_response_id_continues_the_conversation_and_delete_ends_it(client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(model=MODEL, input="My name is Ada.", instructions="Answer briefly.",
                                          max_output_tokens=8)
    second = await client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                           max_output_tokens=8)
    assert second.previous_response_id == first.id and second.output_text
    assert first.usage is not None and second.usage is not None
    # The second prompt holds the first exchange (less its instructions, which do not carry over).
    alone = await client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8, store=False)
    assert alone.usage is not None and (alone.model_extra or {})["store"] is False
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    # A chain: the third continues the second, whose stored conversation holds the first.
    third = await client.responses.create(model=MODEL, input="And again?", previous_response_id=second.id,
                                          max_output_tokens=8)
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens

    retrieved = await client.responses.retrieve(first.id)
    assert retrieved.model_dump() == first.model_dump()
    with pytest.raises(openai.BadRequestError) as cancelled:  # finished: only background ones can be
        await client.responses.cancel(first.id)
    assert "Cannot cancel a synchronous response" in cancelled.value.message
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel("resp_" + "0" * 32)
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as continued:
        await client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert continued.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):  # store=False: never stored
        await client.responses.retrieve(alone.id)
    # The later responses hold their own copy of the conversation: deleting the first does not break them.
    assert (await client.responses.create(model=MODEL, input="Still there?", previous_response_id=third.id,
                                          max_output_tokens=4)).output_text


async def test_input_items_list_what_a_response_answered(client: openai.AsyncOpenAI) -> None:
    """The SDK's ``responses.input_items.list``: newest first by default, paged, each item
    with an id and content parts; earlier turns of a chain included (what the model saw)."""
    first = await client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4)
    assert (first.completed_at is not None) == (first.status == "completed")
    second = await client.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=4,
        input=[{"role": "user", "content": "What is my name?"},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Briefly."}]}])
    page = await client.responses.input_items.list(second.id)
    items = page.data
    assert [i.type for i in items] == ["message"] * 4  # Briefly, What is my name?, the first answer, My name is Ada.
    texts = []
    for i in items:
        assert isinstance(i, ResponseInputMessageItem | ResponseOutputMessage), i
        part = i.content[0]
        assert isinstance(part, ResponseInputText | ResponseOutputText), part
        texts.append(part.text)
    assert texts[0] == "Briefly." and texts[1] == "What is my name?" and texts[3] == "My name is Ada."
    assert items[2].id == first.output[0].id  # the first response's own output item, as it was
    assert len({i.id for i in items}) == 4 and all(i.id for i in items)
    again = await client.responses.input_items.list(second.id)
    assert [i.id for i in again.data] == [i.id for i in items]  # stable ids
    oldest = await client.responses.input_items.list(second.id, order="asc", limit=1)
    assert [i.id for i in oldest.data] == [items[3].id] and oldest.has_more
    rest = await client.responses.input_items.list(second.id, order="asc", limit=10, after=items[3].id)
    assert [i.id for i in rest.data] == [i.id for i in reversed(items[:3])] and not rest.has_more
    with pytest.raises(openai.BadRequestError) as bad:
        await client.responses.input_items.list(second.id, limit=101)
    assert bad.value.body["param"] == "limit"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await client.responses.input_items.list("resp_nope")


async def test_another_orgs_response_does_not_exist_for_it(bus: Bus, gateway: GatewayService,
                                                           client: openai.AsyncOpenAI) -> None:
    mine = await client.responses.create(model=MODEL, input="secret", max_output_tokens=4)
    other = await _client(bus, gateway, "org-b")
    same_org = await _client(bus, gateway, "org-a")
    with pytest.raises(openai.NotFoundError) as retrieved:
        await other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as continued:
        await other.responses.create(model=MODEL, input="tell me", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError) as deleted:
        await other.responses.delete(mine.id)
    unknown = "resp_" + "0" * 24
    with pytest.raises(openai.NotFoundError) as never:
        await other.responses.retrieve(unknown)
    # Exactly the answer an unknown id gets: nothing tells the other org the id exists.
    body, unknown_body = retrieved.value.body, never.value.body
    assert isinstance(body, dict) and isinstance(unknown_body, dict)
    assert body == {**unknown_body, "message": unknown_body["message"].replace(unknown, mine.id)}
    assert continued.value.status_code == deleted.value.status_code == 404
    assert (await client.responses.retrieve(mine.id)).id == mine.id  # still there for its own org
    # A key of the same org sees it.
    assert (await same_org.responses.retrieve(mine.id)).output_text == mine.output_text
    await other.close()
    await same_org.close()


async def test_errors_are_openai_4xx_naming_the_responses_field(client: openai.AsyncOpenAI, gateway: GatewayService) -> None:
    with pytest.raises(openai.BadRequestError) as tool:
        await client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert tool.value.body["param"] == "tools[0].type"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as background:
        await client.responses.create(model=MODEL, input="x", background=True)
    assert background.value.body["param"] == "background"  # type: ignore[index]
    # The chat path's checks, their params renamed to the Responses fields.
    with pytest.raises(openai.BadRequestError) as zero:
        await client.responses.create(model=MODEL, input="x", max_output_tokens=0)
    assert zero.value.body["param"] == "max_output_tokens"  # type: ignore[index]
    assert "max_completion_tokens" not in zero.value.body["message"]  # type: ignore[index]
    # An effort the Responses API takes is one chat takes too (it was a 400 naming reasoning_effort).
    # Served, cut at 3 tokens or ended sooner: the sim's output may stop at once (CI saw one).
    assert (await client.responses.create(model=MODEL, input="x", max_output_tokens=3,
                                          reasoning={"effort": "xhigh"})).status in ("incomplete", "completed")
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.responses.create(model=MODEL, input="x", max_output_tokens=10**6)
    assert too_long.value.code == "context_length_exceeded" and too_long.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as empty:
        await client.responses.create(model=MODEL, input=[])
    assert empty.value.body["param"] == "input" and "'messages'" not in empty.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as model:
        await client.responses.create(model="no-such-model", input="x")
    assert model.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("not-a-response-id")
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {client.api_key}"}
        async with http.post(f"{gateway.http_url}/v1/responses", data=b"{nope", headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        async with http.post(f"{gateway.http_url}/v1/responses", json={"model": MODEL, "input": "x"}) as r:
            assert r.status == 401
        huge = {"model": MODEL, "input": "x" * (gateway.config.max_body_bytes + 1)}
        async with http.post(f"{gateway.http_url}/v1/responses", json=huge, headers=headers) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "payload_too_large"
        async with http.post(f"{gateway.http_url}/v1/responses/resp_x", headers=headers) as r:
            assert r.status == 405


async def test_structured_output_and_a_forced_tool_call(client: openai.AsyncOpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    response = await client.responses.create(
        model=MODEL, input="A city, as JSON.", max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert response.status == "completed"
    data = json.loads(response.output_text)
    assert set(data) == {"city", "population"} and isinstance(data["population"], int)
    assert response.text is not None and response.text.format is not None and response.text.format.type == "json_schema"

    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    stream = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools,  # type: ignore[call-overload]
                                           tool_choice="required", max_output_tokens=2000, stream=True)
    events = [event async for event in stream]
    final = events[-1].response  # type: ignore[union-attr]
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == "".join(call.arguments for call in calls)
    # The SDK's helpers: parse() with a Pydantic model, and stream(), which rebuilds the
    # response from the events and checks their order and identities.
    parsed = await client.responses.parse(model=MODEL, input="A city.", text_format=City, max_output_tokens=200)
    assert parsed.output_parsed is not None and isinstance(parsed.output_parsed.population, int)
    async with client.responses.stream(model=MODEL, input="Weather?", tools=tools,  # type: ignore[call-overload]
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=200) as events_stream:
        rebuilt = await events_stream.get_final_response()
    assert [item.type for item in rebuilt.output] == ["function_call"]
    assert isinstance(json.loads(rebuilt.output[0].arguments)["city"], str)  # type: ignore[union-attr]
    # The tool's answer goes back as a function_call_output item, continuing the stored response.
    answer = await client.responses.create(
        model=MODEL, previous_response_id=final.id, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert answer.status in ("completed", "incomplete") and answer.output_text


async def test_the_store_bucket_has_the_configured_ttl_and_entries_expire(bus: Bus) -> None:
    kv = await responses_bucket(bus.js, bus.subjects, ttl_s=3600.0)
    assert (await bus.js.stream_info(f"KV_{bus.subjects.responses_bucket}")).config.max_age == 3600.0
    kv = await responses_bucket(bus.js, bus.subjects, ttl_s=1.0)  # the setting changed: the bucket follows
    assert (await bus.js.stream_info(f"KV_{bus.subjects.responses_bucket}")).config.max_age == 1.0
    store = ResponseStore(kv, bus.max_payload)
    stored = StoredResponse(response={"id": "resp_ttl", "output": []}, conversation=[])
    assert await store.save("org-a", stored)
    assert await store.load("org-a", "resp_ttl") == stored and await store.load("org-b", "resp_ttl") is None
    for _ in range(100):  # gone after the TTL (the server expires entries on its own schedule)
        if await store.load("org-a", "resp_ttl") is None:
            break
        await asyncio.sleep(0.1)
    assert await store.load("org-a", "resp_ttl") is None
    # Too large for the bus even compressed: not stored, and said so.
    huge = StoredResponse(response={"id": "resp_big"}, conversation=[{"content": os.urandom(bus.max_payload).hex()}])
    assert not await store.save("org-a", huge)


async def test_reasoning_and_logprobs_come_as_their_items(bus_settings: BusSettings, client: openai.AsyncOpenAI) -> None:
    """A model whose worker names the ``think`` reasoning parser: its reasoning is an output
    item of its own, counted in the usage (guided decoding makes the sim spell the tags)."""
    worker = WorkerService(SimEngine(model="sim-think", speed=50.0), WorkerConfig(worker_id="w2", reasoning_parser="think"),
                           bus_settings)
    await worker.start()
    try:
        for _ in range(100):
            if "sim-think" in [m.id async for m in client.models.list()]:
                break
            await asyncio.sleep(0.1)
        shape = r"<think>[a-z]{4,12}</think>[A-Z][a-z]{3,12}"
        body = {"guided_regex": shape}
        response = await client.responses.create(model="sim-think", input="Think, then answer.", max_output_tokens=60,
                                                 include=["message.output_text.logprobs"], top_logprobs=2,
                                                 extra_body=body)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        reasoning = response.output[0].content[0].text  # type: ignore[union-attr,index]
        assert reasoning.isalpha() and reasoning.islower() and response.output_text.istitle()
        assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens > 0
        logprobs = response.output[1].content[0].logprobs  # type: ignore[union-attr,index]
        assert logprobs and all(len(lp.top_logprobs) == 2 for lp in logprobs)
        assert len(logprobs) == response.usage.output_tokens  # every generated token's, as vLLM reports them

        stream = await client.responses.create(model="sim-think", input="Again.", max_output_tokens=60, stream=True,
                                               include=["message.output_text.logprobs"], extra_body=body)
        events = [event async for event in stream]
        final = events[-1].response  # type: ignore[union-attr]
        assert [item.type for item in final.output] == ["reasoning", "message"]
        streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert streamed == final.output[0].content[0].text and streamed.islower()  # type: ignore[union-attr,index]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
        assert final.usage is not None and len(final.output[1].content[0].logprobs) == final.usage.output_tokens  # type: ignore[union-attr,arg-type,index]
        async with client.responses.stream(model="sim-think", input="Once more.", max_output_tokens=60,
                                           extra_body=body) as events_stream:
            rebuilt = await events_stream.get_final_response()
        assert [item.type for item in rebuilt.output] == ["reasoning", "message"] and rebuilt.output_text
    finally:
        await worker.drain_and_close()
