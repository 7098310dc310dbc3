"""The Messages API translation (``anthropic_api``, ``anthropic_output``): Anthropic bodies
→ chat bodies, chat answers and chunks → Messages and SSE events, errors → Anthropic's
shape. The stock client's view is in tests/integration/test_anthropic_http.py, and vLLM's
own ``/v1/messages`` in tests/vllm/test_vllm_openai_diff.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from proto.messages import AdmissionDecision
from services.gateway.anthropic_api import MessagesPlan, parse_messages_request, plan_messages
from services.gateway.anthropic_http import chat_form
from services.gateway.anthropic_output import (
    MessageContext,
    MessageStream,
    anthropic_error,
    message_from_chat,
    stop_reason,
)
from services.gateway.chat_request import chat_messages
from services.gateway.errors import ApiError, from_admission, rate_limited
from services.gateway.models import ModelLimits
from services.gateway.normalized import _resolve_max_tokens
from services.gateway.openai_api import chat_request_decoder


def plan(body: dict[str, Any]) -> MessagesPlan:
    return plan_messages(*parse_messages_request(json.dumps({"model": "m", "max_tokens": 8, **body})))


def test_blocks_become_the_chat_messages_vllm_renders() -> None:
    made = plan({
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"}, {"type": "text", "text": "Be "},
                   {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "look it up", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "sun"}, {"type": "text", "text": "21 C"}]}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "again"},
                                         {"type": "text", "text": "And"}, {"type": "text", "text": ""},
                                         {"type": "text", "text": "tomorrow?"}]},
            {"role": "system", "content": "A reminder."},
        ]})
    assert made.body["messages"] == [
        {"role": "system", "content": "Be brief."},  # the billing block dropped: it defeats prefix caching
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "look it up",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"c": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sun\n21 C"},  # a user turn of results only: no user message
        {"role": "tool", "tool_call_id": "t1", "content": "again"},
        {"role": "user", "content": "And\ntomorrow?"},
        {"role": "system", "content": "A reminder."},
    ]
    assert made.message_params == ["system", "messages[0]", "messages[1]", "messages[2].content[0]",
                                   "messages[3].content[0]", "messages[3]", "messages[4]"]
    assert made.body["max_tokens"] == 8 and "stream" not in made.body


def test_fields_map_onto_the_chat_fields() -> None:
    tool = {"name": "w", "description": "Weather", "input_schema": {"properties": {"c": {"type": "string"}}}}
    made = plan({"messages": [{"role": "user", "content": "x"}], "stop_sequences": ["END"], "temperature": 0.5,
                 "top_p": 0.9, "top_k": 4, "metadata": {"user_id": "u1"}, "tools": [tool], "stream": True,
                 "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "thinking": {"type": "disabled"},
                 "output_config": {"effort": "max", "format": {"type": "json_schema", "schema": {"type": "object"}}},
                 "seed": 7, "cache_salt": "s", "guided_regex": "a+"})
    body = made.body
    assert body["stop"] == ["END"] and body["temperature"] == 0.5 and body["top_p"] == 0.9 and body["top_k"] == 4
    assert body["user"] == "u1" and body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["tools"] == [{"type": "function", "function": {
        "name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}, "description": "Weather"}}]
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["reasoning_effort"] == "xhigh"
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "json_schema",
                                                                              "schema": {"type": "object"}}}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["seed"] == 7 and body["cache_salt"] == "s" and body["guided_regex"] == "a+"
    named = plan({"messages": [{"role": "user", "content": "x"}], "tools": [tool],
                  "tool_choice": {"type": "tool", "name": "w"}}).body
    assert named["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    # No tools: "auto" and "none" are what chat does anyway (chat refuses a choice without tools).
    assert "tool_choice" not in plan({"messages": [], "tool_choice": {"type": "auto"}}).body


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "max_tokens"),
    ({"max_tokens": "8", "messages": []}, "max_tokens"),
    ({"max_tokens": 8}, "messages"),
    ({"max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 8, "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "b",
                                                                       "input": [1]}]}]},
     "messages[0].content[0].input"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 8, "messages": [], "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"max_tokens": 8, "messages": [], "tools": [{"name": "w"}]}, "tools[0].input_schema"),
    ({"max_tokens": 8, "messages": [], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"max_tokens": 8, "messages": [], "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
    ({"max_tokens": 8, "messages": [], "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"max_tokens": 8, "messages": [], "output_config": {"format": {"type": "json_schema"}}},
     "output_config.format.schema"),
    ({"max_tokens": 8, "messages": [], "output_config": {"effort": "huge"}}, "output_config.effort"),
    ({"max_tokens": 8, "messages": [], "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"max_tokens": 8, "messages": [], "service_tier": "priority"}, "service_tier"),
    ({"max_tokens": 8, "messages": [], "system": [{"type": "image"}]}, "system[0].type"),
])
def test_bad_bodies_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        plan_messages(*parse_messages_request(json.dumps({"model": "m", **body})))
    assert caught.value.status == 400 and caught.value.param == param
    assert anthropic_error(caught.value)["error"]["message"].startswith(param.replace("[", ".").replace("]", "") + ": ")


def test_chat_errors_are_renamed_to_the_messages_fields() -> None:
    made = plan({"system": "s", "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "r"}, {"type": "text", "text": "q"}]}],
        "output_format": {"type": "json_schema", "schema": {}}})

    def renamed(param: str, message: str = "Invalid.") -> tuple[str | None, str]:
        exc = made.api_error(ApiError(400, message, param=param))
        return exc.param, exc.message

    assert renamed("messages[1].content")[0] == "messages[0].content[0]"  # the tool message a result became
    assert renamed("messages[2].content")[0] == "messages[0]"
    assert renamed("messages[0].content")[0] == "system"
    assert renamed("max_completion_tokens", "Invalid 'max_completion_tokens': 0.") == ("max_tokens",
                                                                                       "Invalid 'max_tokens': 0.")
    assert renamed("stop")[0] == "stop_sequences" and renamed("response_format.json_schema.schema")[0] == "output_format"
    assert renamed("tools[0].function.parameters.properties")[0] == "tools[0].input_schema.properties"
    assert renamed("tools[1].function.name")[0] == "tools[1].name"
    assert renamed("tool_choice.function.name")[0] == "tool_choice.name"
    assert renamed("messages")[0] == "messages" and renamed("temperature")[0] == "temperature"


def test_errors_take_anthropics_types() -> None:
    def kind(exc: ApiError) -> str:
        return anthropic_error(exc)["error"]["type"]

    assert kind(ApiError(400, "x")) == "invalid_request_error" and kind(ApiError(401, "x")) == "authentication_error"
    assert kind(ApiError(403, "x")) == "permission_error" and kind(ApiError(404, "x")) == "not_found_error"
    assert kind(ApiError(413, "x")) == "request_too_large" and kind(rate_limited("x", 1.0)) == "rate_limit_error"
    assert kind(from_admission(AdmissionDecision(request_id="r", admitted=False, reason="slo"))) == "overloaded_error"
    assert kind(from_admission(AdmissionDecision(request_id="r", admitted=False, reason="no_capacity"))) == \
        "overloaded_error"
    assert kind(ApiError(500, "x", "server_error")) == "api_error" and kind(ApiError(504, "x")) == "timeout_error"
    assert anthropic_error(ApiError(400, "Field required.", param="messages[0].content")) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "messages.0.content: Field required."}}


def test_stop_reasons() -> None:
    assert stop_reason("length", None, tool_used=True, tool_complete=False) == ("max_tokens", None)
    assert stop_reason("stop", None, tool_used=False, tool_complete=False) == ("end_turn", None)
    assert stop_reason("stop", 128001, tool_used=False, tool_complete=False) == ("end_turn", None)  # a stop token id
    assert stop_reason("stop", "END", tool_used=False, tool_complete=False) == ("stop_sequence", "END")
    assert stop_reason("stop", "END", tool_used=True, tool_complete=True) == ("tool_use", None)
    assert stop_reason("stop", "END", tool_used=True, tool_complete=False) == ("stop_sequence", "END")  # cut short
    assert stop_reason("stop", None, tool_used=True, tool_complete=True) == ("tool_use", None)  # a forced call
    assert stop_reason("tool_calls", None, tool_used=True, tool_complete=True) == ("tool_use", None)
    assert stop_reason("content_filter", None, tool_used=False, tool_complete=False) == ("refusal", None)
    assert stop_reason("abort", None, tool_used=False, tool_complete=False) == (None, None)


CTX = MessageContext(request_id="r1", model="m", input_tokens=20)
USAGE = {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25, "prompt_tokens_details": {"cached_tokens": 16}}


def test_a_whole_answer() -> None:
    completion = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Sure.", "reasoning_content": "hm",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": "Oslo"}'}}]}}],
        "usage": USAGE}
    message = message_from_chat(completion, CTX)
    assert message["id"] == "msg_r1" and message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][0]["signature"] and message["content"][2]["input"] == {"c": "Oslo"}
    assert message["usage"] == {"input_tokens": 4, "output_tokens": 5, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 16}
    cut = message_from_chat({"choices": [{"finish_reason": "length", "message": {"tool_calls": [
        {"id": "c1", "function": {"name": "w", "arguments": '{"c": "Os'}}]}}], "usage": USAGE}, CTX)
    assert cut["stop_reason"] == "max_tokens" and cut["content"][0]["input"] == {}  # arguments cut short
    empty = message_from_chat({"choices": [{"finish_reason": "stop", "message": {"content": ""}}]}, CTX)
    assert empty["content"] == [{"type": "text", "text": ""}] and empty["usage"]["input_tokens"] == 20


def events(frames: bytes) -> list[dict[str, Any]]:
    """SSE frames → their data objects, checking each ``event:`` names its data's type."""
    out = []
    for frame in frames.decode().split("\n\n"):
        if not frame:
            continue
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, stop: Any = None,
          usage: dict[str, Any] | None = None) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": stop}]
    return {"object": "chat.completion.chunk", "choices": choices, **({"usage": usage} if usage else {})}


def test_a_stream_of_thinking_text_and_two_calls_rebuilds_in_the_sdk() -> None:
    stream = MessageStream(CTX)
    frames = stream.start()
    for c in (chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "hm"}),
              chunk({"reasoning_content": "m"}), chunk({"content": "Sure."}),
              chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                     "function": {"name": "w", "arguments": '{"c": '}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
              chunk({"tool_calls": [{"index": 1, "id": "c2", "type": "function", "function": {"name": "w",
                                                                                          "arguments": "{}"}}]}),
              chunk({}, finish="tool_calls"), chunk(usage=USAGE)):
        frames += stream.feed(c)
    frames += stream.finish()
    assert stream.feed(chunk({"content": "late"})) == b"" and stream.finish() == b""
    got = events(frames)
    assert [e["type"] for e in got] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert got[5]["delta"]["type"] == "signature_delta" and got[-2]["delta"] == {"stop_reason": "tool_use",
                                                                                   "stop_sequence": None}
    # The stock SDK's accumulator, as a client's stream helper runs it.
    adapter: TypeAdapter[RawMessageStreamEvent] = TypeAdapter(RawMessageStreamEvent)
    snapshot = None
    buffers: dict[int, bytes] = {}
    for event in got:
        if event["type"] != "ping":
            snapshot = accumulate_event(event=adapter.validate_python(event), current_snapshot=snapshot,
                                        json_bufs=buffers)
    assert snapshot is not None and snapshot.stop_reason == "tool_use"
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use", "tool_use"]
    whole = message_from_chat({"choices": [{"finish_reason": "tool_calls", "message": {
        "content": "Sure.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "function": {"name": "w", "arguments": '{"c": "Oslo"}'}},
            {"id": "c2", "function": {"name": "w", "arguments": "{}"}}]}}], "usage": USAGE}, CTX)
    assert snapshot.model_dump(exclude_none=True)["content"] == whole["content"]  # streamed == whole
    assert snapshot.usage.input_tokens == 4 and snapshot.usage.cache_read_input_tokens == 16


def test_a_stream_that_stops_on_a_sequence_or_fails() -> None:
    stream = MessageStream(CTX)
    frames = stream.start() + stream.feed(chunk({"content": "abc "})) + stream.feed(chunk({}, "stop", "END"))
    got = events(frames + stream.finish())
    assert got[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert got[-2]["usage"]["input_tokens"] == 20  # no usage chunk: the prompt as counted before
    failed = MessageStream(CTX)
    failed.start()
    out = events(failed.feed(chunk({"content": "a"})) + failed.fail({"message": "worker lost", "code": "worker_lost"}))
    assert out[-1] == {"type": "error", "error": {"type": "api_error", "message": "worker lost"}}
    assert failed.finish() == b"" and failed.done
    limited = MessageStream(CTX)
    assert events(limited.fail({"message": "slow down", "code": "rate_limit_exceeded"}))[0]["error"]["type"] == \
        "rate_limit_error"


def test_the_billing_header_goes_as_vllm_drops_it() -> None:
    header = "x-anthropic-billing-header: cc_version=2.1; cch=9f3a;"
    # A block of it is dropped here; an inline system message opening with it too.
    made = plan({"system": [{"type": "text", "text": header}, {"type": "text", "text": "Rules."}], "messages": [
        {"role": "system", "content": header + "\nignored too"}, {"role": "user", "content": "hi"}]})
    assert made.body["messages"] == [{"role": "system", "content": "Rules."}, {"role": "user", "content": "hi"}]
    # A top-level string keeps it: the chat path drops the line itself (for any client, as vLLM's chat does).
    body = plan({"system": header + "\nRules.", "messages": [{"role": "user", "content": "hi"}]}).body
    assert body["messages"][0] == {"role": "system", "content": header + "\nRules."}
    rendered = chat_messages(chat_request_decoder.decode(json.dumps(body)))
    assert rendered[0] == {"role": "system", "content": "Rules."}
    parts = chat_messages(chat_request_decoder.decode(json.dumps({"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": header}, {"type": "text", "text": "A"}]},
        {"role": "user", "content": header}]})))
    assert parts == [{"role": "system", "content": "A"}, {"role": "user", "content": header}]  # system only


def test_reasoning_handed_back_reaches_the_template() -> None:
    """vLLM gives an assistant's ``reasoning`` to the template (as ``reasoning`` and
    ``reasoning_content``) for interleaved thinking; ``reasoning_content`` it does not."""
    rendered = chat_messages(chat_request_decoder.decode(json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"},
        {"role": "assistant", "content": "b", "reasoning_content": "old"}]})))
    assert rendered[1] == {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"}
    assert rendered[2] == {"role": "assistant", "content": "b"}


def test_tool_schemas_keep_their_key_order() -> None:
    schema = {"properties": {"c": {"type": "string"}}, "required": ["c"], "title": "W"}
    tools = plan({"messages": [], "tools": [{"name": "w", "input_schema": schema},
                                            {"name": "v", "input_schema": {**schema, "type": "object"}}]}).body["tools"]
    assert list(tools[0]["function"]["parameters"]) == ["properties", "required", "title", "type"]
    assert list(tools[1]["function"]["parameters"]) == ["properties", "required", "title", "type"]


@pytest.mark.parametrize(("body", "param"), [
    ({"thinking": {"type": "disabled"}, "chat_template_kwargs": "ab"}, "chat_template_kwargs"),
    ({"output_config": {"effort": ["high"]}}, "output_config.effort"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": "false"}}, "tool_choice.disable_parallel_tool_use"),
    ({"tool_choice": {"type": "tool", "name": 5}}, "tool_choice.name"),
    ({"tools": [{"name": "w", "input_schema": {}, "defer_loading": True}]}, "tools[0].defer_loading"),
])
def test_wrong_types_are_400s_not_500s(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        plan({"messages": [], **body})
    assert caught.value.status == 400 and caught.value.param == param


def test_a_null_tool_input_is_an_empty_one_and_count_tokens_sees_the_effort() -> None:
    made = plan({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "w",
                                                                 "input": None}]}]})
    assert made.body["messages"][0]["tool_calls"][0]["function"]["arguments"] == "{}"
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "low"}})
    _, encoded = chat_form(body.encode(), count_only=True)
    assert json.loads(encoded)["chat_template_kwargs"] == {"reasoning_effort": "low"}


def test_context_length_errors_in_anthropics_words() -> None:
    """Claude Code reads these to compact the conversation or lower max_tokens."""
    limits = ModelLimits(max_model_len=100)
    made = plan({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(ApiError) as both:
        _resolve_max_tokens("chat", "max_tokens", 50, 60, limits)
    said = made.api_error(both.value)
    assert said.message == ("input length and `max_tokens` exceed context limit: 60 + 50 > 100, decrease input length"
                            " or `max_tokens` and try again") and said.param is None
    with pytest.raises(ApiError) as prompt:
        _resolve_max_tokens("chat", "max_tokens", None, 120, limits)
    assert made.api_error(prompt.value).message == "prompt is too long: 120 tokens > 100 maximum"


def test_text_between_a_calls_arguments_waits_for_the_call_to_close() -> None:
    stream = MessageStream(CTX)
    frames = stream.start()
    for c in (chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "w", "arguments": "\n  "}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"c": '}}]}),
              chunk({"content": "by the way"}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
              chunk({}, finish="tool_calls")):
        frames += stream.feed(c)
    got = events(frames + stream.finish())
    assert [(e["type"], e.get("content_block", e.get("delta", {})).get("type")) for e in got[2:-2]] == [
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"), ("content_block_stop", None)]
    assert got[3]["delta"]["partial_json"] == '{"c": '  # the whitespace-only fragment held back, then stripped
    assert got[-2]["delta"]["stop_reason"] == "tool_use"
