"""The OpenAI features clients send (issue 16), driven by the stock clients, unchanged,
against a mesh of real processes (``meshserve up``'s machinery, sim workers): tools,
structured outputs, logprobs, n, echo, the rest of vLLM's sampling fields, and the
errors for what stays unsupported. The sim engine honours guided decoding (it spells a
valid instance of the schema), so every check here holds for any model output."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import jsonschema
import nats
import openai
import pytest
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
    ChatCompletionToolMessageParam,
)
from openai.types.responses import FunctionToolParam
from pydantic import BaseModel, SecretStr

from bus import Bus
from ops.up import Mesh
from proto import WorkerGauge, decode
from proto.metering import UsageQuery, UsageReport
from tests.conftest import running_mesh

MODEL = "sim-llama-8b"

WEATHER: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                    "required": ["tz"]}},
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(Path(tmp_path_factory.mktemp("mesh")), workers=1, speed=50.0) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.gateway_url}/v1", api_key=mesh.dev_key, max_retries=0, timeout=60)


class City(BaseModel):
    name: str
    population: int
    coastal: bool


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a city"}], response_format=City, max_tokens=200,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)  # the stock client validated it against the model


def test_json_schema_streamed_is_valid_and_json_object_is_an_object(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                                               "score": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["tags", "score"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tags?"}], max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}],
                                           max_tokens=300, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_guided_choice_regex_and_grammar_extra_fields(client: openai.OpenAI) -> None:
    for _ in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pick"}],
                                               max_tokens=20, extra_body={"guided_choice": ["red", "green", "blue"]})
        assert reply.choices[0].message.content in ("red", "green", "blue")
    completion = client.completions.create(model=MODEL, prompt="phone:", max_tokens=30,
                                           extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert completion.choices[0].text[:3].isdigit() and completion.choices[0].text[3] == "-"


def test_invalid_schema_is_a_400_naming_the_parameter(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )
    assert err.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"guided_regex": "(unclosed"})
    assert err.value.body["param"] == "guided_regex"  # type: ignore[index]


def test_required_tool_call_and_a_tool_result_in_the_history(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME],
        tool_choice="required", max_tokens=2000,  # a random array of calls: room for the longest
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert calls and all(c.id.startswith("call_") for c in calls)
    for call in calls:
        assert isinstance(call, ChatCompletionMessageFunctionToolCall), call
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # the next turn: the assistant's calls and the tool's answers in the history
    history: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Weather in Paris?"},
        # the SDK's own tool calls, dumped: the param shape, which model_dump's dict[str, Any] does not say
        {"role": "assistant", "content": None,
         "tool_calls": [cast(ChatCompletionMessageFunctionToolCallParam, c.model_dump()) for c in calls]},
        *(ChatCompletionToolMessageParam(role="tool", tool_call_id=c.id, content='{"temp": 21}') for c in calls),
    ]
    follow = client.chat.completions.create(model=MODEL, max_tokens=10, tools=[WEATHER, TIME], tool_choice="none",
                                            messages=history)
    assert follow.choices[0].message.content is not None and not follow.choices[0].message.tool_calls


def test_named_tool_call_streams_its_arguments(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, TIME], max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
    )
    name, arguments, ids = "", "", set()
    for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert delta.index == 0
            ids.add(delta.id) if delta.id else None
            name += (delta.function.name or "") if delta.function else ""
            arguments += (delta.function.arguments or "") if delta.function else ""
    assert name == "get_weather" and len(ids) == 1
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_logprobs_chat_streamed_and_not(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           logprobs=True, top_logprobs=3, seed=5)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        ranked = [t.logprob for t in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True) and entry.bytes == list(entry.token.encode())
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                            logprobs=True, top_logprobs=3, seed=5, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert plain.choices[0].logprobs is None  # only when asked: they are large


def test_n_choices_share_one_request(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}], n=3,
                                           max_tokens=12, seed=11, temperature=1.0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) == 3  # seeds 11, 12, 13
    # The byte tokenizer: one token a byte, plus the EOS of a choice that stopped on its own.
    per_choice = [len((c.message.content or "").encode()) + (c.finish_reason == "stop") for c in reply.choices]
    assert reply.usage is not None and reply.usage.completion_tokens == sum(per_choice)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}], n=3,
                                            max_tokens=12, seed=11, stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in reply.choices}
    assert set(finishes) == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens
    assert usage.prompt_tokens == reply.usage.prompt_tokens  # the prompt counts once


def test_completions_echo_with_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, echo=True, logprobs=2, seed=1)
    choice = reply.choices[0]
    assert choice.text.startswith("The sky is")
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None and lp.top_logprobs is not None
    prompt_tokens = reply.usage.prompt_tokens  # type: ignore[union-attr]
    assert len(lp.tokens) == prompt_tokens + reply.usage.completion_tokens  # type: ignore[union-attr]
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[prompt_tokens:]) == choice.text[len("The sky is"):]
    assert lp.text_offset == sorted(lp.text_offset)


def test_a_batch_of_prompts_answers_as_each_prompt_alone(client: openai.OpenAI) -> None:
    """OpenAI's batched completions (several prompts, strings or token ids): prompt i's
    choice j at index i * n + j, each as the prompt sent alone (same seed), usage summed.
    Evaluation harnesses send these; they were a 400."""
    prompts = ["The sky is", "Once upon a time", "1, 2, 3,"]
    reply = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, seed=3, temperature=1.0,
                                      logprobs=1, echo=True)
    assert [c.index for c in reply.choices] == list(range(6))
    prompt_total = completion_total = 0
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=6, seed=3, temperature=1.0,
                                          logprobs=1, echo=True)
        for j in range(2):
            got, want = reply.choices[i * 2 + j], alone.choices[j]
            assert got.text == want.text and got.text.startswith(prompt)
            assert got.logprobs is not None and want.logprobs is not None
            assert got.logprobs.tokens == want.logprobs.tokens and got.finish_reason == want.finish_reason
        assert alone.usage is not None
        prompt_total += alone.usage.prompt_tokens
        completion_total += alone.usage.completion_tokens
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_total, completion_total)
    assert reply.usage.total_tokens == prompt_total + completion_total
    ids = client.completions.create(model=MODEL, prompt=[[72, 105], [79, 107, 33]], max_tokens=2)
    assert [c.index for c in ids.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as bad:  # one bad prompt: the batch is refused, nothing runs
        client.completions.create(model=MODEL, prompt=["fine", ""], max_tokens=2)
    assert bad.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as streamed:
        client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, stream=True)
    assert streamed.value.body["param"] == "stream"  # type: ignore[index]


def test_sampling_fields_pass_through(client: openai.OpenAI) -> None:
    # The byte tokenizer: id 3 + ord(c). A +100 bias forces "x"; the rest are vLLM's fields.
    x = 3 + ord("x")
    reply = client.completions.create(model=MODEL, prompt="a", max_tokens=6, logit_bias={str(x): 100},
                                      extra_body={"min_p": 0.1, "top_k": 5, "min_tokens": 6,
                                                  "skip_special_tokens": True, "include_stop_str_in_output": False,
                                                  "spaces_between_special_tokens": True, "truncate_prompt_tokens": 1})
    assert reply.choices[0].text == "xxxxxx" and reply.usage.prompt_tokens == 1  # type: ignore[union-attr]
    stopped = client.completions.create(model=MODEL, prompt="a", max_tokens=6, logit_bias={str(x): 100}, stop=["xx"],
                                        extra_body={"include_stop_str_in_output": True})
    assert stopped.choices[0].text == "xx"


@pytest.mark.parametrize(("field", "value", "param"), [
    ("logit_bias", {"999999": 5}, "logit_bias"),
    ("logit_bias", {"5": 500}, "logit_bias"),
    ("n", 0, "n"),
    ("top_logprobs", 3, "top_logprobs"),  # without logprobs
    ("tool_choice", "required", "tool_choice"),  # without tools
    ("tools", [{"type": "function", "function": {"name": "bad name!"}}], "tools[0].function.name"),
    ("functions", [{"name": "f"}], "functions"),
    ("metadata", {"k": 5}, "metadata.k"),
])
def test_bad_fields_are_400s_naming_the_parameter(client: openai.OpenAI, field: str, value: object, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       extra_body={field: value})
    assert err.value.body["param"] == param  # type: ignore[index]


def test_langchain_tools_structured_output_and_stream(mesh: Mesh) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{mesh.gateway_url}/v1", api_key=SecretStr(mesh.dev_key),
                     max_completion_tokens=200, max_retries=0)
    structured = llm.with_structured_output(City).invoke("Describe a city")
    assert isinstance(structured, City)
    # langchain takes any OpenAI tool dict, annotated dict[str, Any], which a TypedDict never is
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")  # type: ignore[list-item]
    message = bound.invoke("Weather in Oslo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER["function"]["parameters"])
    pieces = list(llm.stream("Say something"))
    assert pieces and "".join(str(p.content) for p in pieces)


def test_every_front_door_gives_the_same_choices(mesh: Mesh, client: openai.OpenAI) -> None:
    """HTTP, SSE, WebSocket and NATS share one implementation: a seeded request with n,
    logprobs and a forced tool call gives the same choices through each."""
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "n": 2, "seed": 3,
                            "max_tokens": 200, "logprobs": True, "top_logprobs": 2, "tools": [WEATHER],
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    http = client.chat.completions.create(**body).model_dump()
    want = {c["index"]: (c["message"]["tool_calls"][0]["function"]["arguments"], c["finish_reason"],
                         [e["logprob"] for e in c["logprobs"]["content"]]) for c in http["choices"]}
    assert len(want) == 2 and want[0] != want[1]

    def fold(deltas: list[tuple[int, str, str | None, list[float]]]) -> dict[int, tuple[str, str | None, list[float]]]:
        out: dict[int, tuple[str, str | None, list[float]]] = {}
        for index, arguments, finish, logprobs in deltas:
            a, f, lp = out.get(index, ("", None, []))
            out[index] = (a + arguments, finish or f, lp + logprobs)
        return out

    sse = client.chat.completions.create(**body, stream=True)
    assert fold([(c.index, "".join(t.function.arguments or "" for t in c.delta.tool_calls or []), c.finish_reason,
                  [e.logprob for e in (c.logprobs.content or [])] if c.logprobs else [])
                 for chunk in sse for c in chunk.choices]) == want

    async def over_ws_and_nats() -> tuple[dict[int, Any], dict[int, Any]]:
        ws_deltas = []
        async with aiohttp.ClientSession() as session, session.ws_connect(
                f"{mesh.gateway_url}/v1/ws?api_key={mesh.dev_key}") as ws:
            await ws.send_json({"type": "chat.completion", "id": "q1", "body": body})
            async for message in ws:
                frame = json.loads(message.data)
                assert frame["type"] != "error", frame
                if frame["type"] == "done":
                    break
                ws_deltas.append((frame.get("index", 0), "".join(t["function"].get("arguments", "")
                                                                  for t in frame.get("tool_calls") or []),
                                  frame.get("finish_reason"), [e["logprob"] for e in frame.get("logprobs") or []]))
        nc = await nats.connect(mesh.nats_url)
        try:
            reply = await nc.request("mesh.api.v1.chat.completions", json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {mesh.dev_key}"}, timeout=60)
        finally:
            await nc.close()
        over_nats = {c["index"]: (c["message"]["tool_calls"][0]["function"]["arguments"], c["finish_reason"],
                                  [e["logprob"] for e in c["logprobs"]["content"]])
                     for c in json.loads(reply.data)["choices"]}
        return fold(ws_deltas), over_nats

    over_ws, over_nats = asyncio.run(over_ws_and_nats())
    assert over_ws == want and over_nats == want


HOSTILE: list[dict[str, Any]] = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "string"}, "minItems": 1_000_000_000}}}},
    {"guided_regex": "a{100000000}"},
    {"guided_regex": "(a|b)*" * 200},
    {"guided_regex": "[xy]{5000000}"},
    {"guided_grammar": "root ::= root"},
    {"guided_json": {"$ref": "#/nowhere"}},
    {"guided_choice": [""]},
    {"logit_bias": {"2": 100}, "min_tokens": 0},  # EOS forced at once
    {"n": 16, "max_tokens": 64, "logprobs": True, "top_logprobs": 20},
    {"tools": [WEATHER] * 2},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                        "function": {"name": "f", "arguments": "{"}}]}]},
    {"chat_template_kwargs": {"messages": []}},
    {"structured_outputs": {"json": {"type": "object"}, "regex": "x"}},
]


def test_hostile_feature_requests_get_4xx_or_an_answer_and_leave_nothing_behind(mesh: Mesh) -> None:
    async def run() -> list[int]:
        statuses = []
        async with aiohttp.ClientSession(mesh.gateway_url) as http:
            for extra in HOSTILE:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, **extra}
                async with http.post("/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {mesh.dev_key}"}) as r:
                    statuses.append(r.status)
                    assert r.status < 500, (extra, await r.text())
                    if r.status == 200:
                        assert (await r.json())["usage"]["completion_tokens"] >= 0
        return statuses

    async def requests_billed() -> int:
        bus = await Bus.open(mesh.settings, "feature-check", initial_attempts=10)
        try:
            report = await bus.request(bus.subjects.metering_usage, UsageQuery(org="dev", group_by=[]), UsageReport,
                                       timeout=5)
            return report.rows[0].requests if report.rows else 0
        finally:
            await bus.close()

    async def idle_gauge() -> WorkerGauge:
        bus = await Bus.open(mesh.settings, "feature-gauges", initial_attempts=10)
        gauges: list[WorkerGauge] = []

        async def on_gauge(msg: Any) -> None:
            gauges.append(decode(msg.data, WorkerGauge))

        sub = await bus.nc.subscribe(bus.subjects.gauges_of_model(MODEL), cb=on_gauge)
        try:
            for _ in range(100):
                if gauges and gauges[-1].running == 0 and gauges[-1].waiting == 0:
                    break
                await asyncio.sleep(0.1)
            return gauges[-1]
        finally:
            await sub.unsubscribe()
            await bus.close()

    before = asyncio.run(requests_billed())
    statuses = asyncio.run(run())
    assert statuses.count(200) >= 3  # the valid ones were served
    gauge = asyncio.run(idle_gauge())
    assert gauge.running == 0 and gauge.waiting == 0 and gauge.kv_blocks_used == 0
    for _ in range(50):  # every admitted request has its usage record
        billed = asyncio.run(requests_billed()) - before
        if billed >= statuses.count(200):
            break
        time.sleep(0.1)
    assert billed >= statuses.count(200)


def test_responses_api_streams_and_continues_a_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=12, store=True)
    assert first.output_text
    assert first.status == "completed" or (first.incomplete_details is not None
                                           and first.incomplete_details.reason == "max_output_tokens")
    deltas, completed = [], None
    with client.responses.stream(model=MODEL, input="And again", previous_response_id=first.id,
                                 max_output_tokens=12) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
                completed = event.response
    assert completed is not None and "".join(deltas) == completed.output_text
    # the continuation's prompt held the first exchange: more input tokens than the first
    assert completed.usage is not None and first.usage is not None
    assert completed.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(completed.id).output_text == completed.output_text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    structured = client.responses.create(model=MODEL, input="ok?", max_output_tokens=50,
                                         text={"format": {"type": "json_schema", "name": "ok", "schema": schema}})
    jsonschema.validate(json.loads(structured.output_text), schema)
    # the chat tool's function as it is: no "strict" (the SDK's type requires the key), and
    # "parameters" optional in the chat type though WEATHER has it
    weather: FunctionToolParam = {"type": "function", **WEATHER["function"]}  # type: ignore[typeddict-item]
    forced = client.responses.create(model=MODEL, input="Weather?", max_output_tokens=2000, tool_choice="required",
                                     tools=[weather])
    calls = [item for item in forced.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    client.responses.delete(completed.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(completed.id)


def test_a_client_gone_cancels_every_choice(mesh: Mesh) -> None:
    """n = 3 long streams, the client leaves after the first events: all three engine
    requests stop, nothing is left running, and one usage record bills what was streamed."""
    async def stream_then_leave() -> None:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 8000, "ignore_eos": True, "n": 3, "stream": True}
        async with aiohttp.ClientSession(mesh.gateway_url) as http:
            async with http.post("/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {mesh.dev_key}"}) as r:
                seen = 0
                async for line in r.content:
                    seen += line.startswith(b"data: {")
                    if seen >= 6:
                        break  # leaving the block closes the connection mid-stream

    async def by_status() -> dict[str | None, tuple[int, int]]:
        bus = await Bus.open(mesh.settings, "cancel-check", initial_attempts=10)
        try:
            report = await bus.request(bus.subjects.metering_usage, UsageQuery(org="dev", group_by=["status"]),
                                       UsageReport, timeout=5)
            return {row.status: (row.requests, row.completion_tokens) for row in report.rows}
        finally:
            await bus.close()

    before = asyncio.run(by_status()).get("cancelled", (0, 0))
    asyncio.run(stream_then_leave())
    after = before
    for _ in range(100):
        after = asyncio.run(by_status()).get("cancelled", (0, 0))
        if after[0] > before[0]:
            break
        time.sleep(0.1)
    assert after[0] == before[0] + 1  # one record for the request, its three choices in it
    assert 0 < after[1] - before[1] < 3 * 8000  # stopped long before the end
