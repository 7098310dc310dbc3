"""The choice assembler: chunks → OpenAI choices, streamed and whole, for every feature
(issue 16). The stock SDK's types validate every shape; the streamed deltas, put
together, always equal the non-streamed response."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from proto import OutputOptions, TokenChunk, TokenLogprob, TopLogprob, Usage
from services.gateway.events import EventBuilder
from services.gateway.output import ChoiceAssembler, tool_call_id

USAGE = Usage(prompt_tokens=5, completion_tokens=4, cached_tokens=1)


def lp(token: str, value: float, k: int = 2) -> TokenLogprob:
    top = [TopLogprob(ord(token[0]), token, value)] + [TopLogprob(i, f"t{i}", value - i) for i in range(1, k)]
    return TokenLogprob(ord(token[0]), token, value, top)


def run(kind: str, options: OutputOptions, chunks: list[TokenChunk]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The non-streamed response and the streamed chunks of the same chunks."""
    whole = ChoiceAssembler(kind, "r1", "m", 7, options)  # type: ignore[arg-type]
    for chunk in chunks:
        whole.deltas(chunk)
    builder = EventBuilder(kind, "r1", "m", 7, True, options)
    streamed = [json.loads(e.data) for c in chunks for e in builder.events(c) if e.data != b"[DONE]"]
    return json.loads(whole.response(chunks[-1].usage)), streamed


def merged_chat(streamed: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The streamed chat deltas put together per choice, as a client does."""
    out: dict[int, dict[str, Any]] = {}
    for raw in streamed:
        ChatCompletionChunk.model_validate(raw)
        for c in raw["choices"]:
            m = out.setdefault(c["index"], {"content": "", "reasoning": "", "calls": {}, "finish": None, "lp": []})
            d = c["delta"]
            m["content"] += d.get("content") or ""
            m["reasoning"] += d.get("reasoning_content") or ""
            for call in d.get("tool_calls") or []:
                entry = m["calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                entry["name"] += (call.get("function") or {}).get("name") or ""
                entry["arguments"] += (call.get("function") or {}).get("arguments") or ""
            if c.get("logprobs"):
                m["lp"] += c["logprobs"]["content"]
            m["finish"] = c["finish_reason"] or m["finish"]
    return out


def test_plain_chat_matches_the_sdk_types_and_the_stream() -> None:
    chunks = [TokenChunk(request_id="r1", seq=0, token_ids=[1, 2], text="hel"),
              TokenChunk(request_id="r1", seq=1, token_ids=[3], text="lo", finish_reason="stop", usage=USAGE)]
    whole, streamed = run("chat", OutputOptions(), chunks)
    parsed = ChatCompletion.model_validate(whole)
    assert parsed.choices[0].message.content == "hello" and parsed.choices[0].finish_reason == "stop"
    assert parsed.choices[0].logprobs is None and "tool_calls" not in whole["choices"][0]["message"]
    assert parsed.usage is not None and parsed.usage.total_tokens == 9
    assert streamed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["total_tokens"] == 9
    assert all(raw["usage"] is None for raw in streamed[:-1])  # include_usage: null until the last
    assert merged_chat(streamed)[0]["content"] == "hello"


def test_completion_shapes_and_echo_with_prompt_logprobs() -> None:
    options = OutputOptions(logprobs=True, top_logprobs=2, echo="ab", echo_first_token="a")
    prompt = [None, lp("b", -1.5)]
    chunks = [TokenChunk(request_id="r1", seq=0, prompt_logprobs=prompt),
              TokenChunk(request_id="r1", seq=1, token_ids=[9], text="c", logprobs=[lp("c", -0.5)]),
              TokenChunk(request_id="r1", seq=2, token_ids=[10], text="d", logprobs=[lp("d", -0.25)],
                         finish_reason="length", usage=USAGE)]
    whole, streamed = run("completion", options, chunks)
    # The prompt's first token has no logprob: null, as vLLM sends it (the SDK's type
    # says float; its client builds responses without validating them).
    assert Completion.model_validate({**whole, "choices": [{**whole["choices"][0], "logprobs": None}]})
    choice = Completion.model_validate({**whole, "choices": [{**whole["choices"][0], "logprobs": {
        k: v[1:] for k, v in whole["choices"][0]["logprobs"].items()}}]}).choices[0]
    assert choice.text == "abcd" and choice.finish_reason == "length"
    raw = whole["choices"][0]["logprobs"]
    assert raw["token_logprobs"] == [None, -1.5, -0.5, -0.25]
    assert raw["tokens"] == ["a", "b", "c", "d"]
    assert raw["top_logprobs"][0] is None and raw["top_logprobs"][2] == {"c": -0.5, "t1": -1.5}
    assert raw["text_offset"] == [0, 1, 2, 3]
    assert choice.logprobs is not None and choice.logprobs.text_offset == [1, 2, 3]
    text = "".join(c["text"] for raw in streamed for c in raw["choices"])
    assert text == "abcd"
    offsets = [o for raw in streamed for c in raw["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == raw["text_offset"]


def test_chat_logprobs_streamed_equal_whole() -> None:
    options = OutputOptions(logprobs=True, top_logprobs=1)
    chunks = [TokenChunk(request_id="r1", seq=0, token_ids=[104], text="h", logprobs=[lp("h", -0.1)]),
              TokenChunk(request_id="r1", seq=1, token_ids=[105], text="i", logprobs=[lp("i", -0.2)],
                         finish_reason="stop", usage=USAGE)]
    whole, streamed = run("chat", options, chunks)
    content = ChatCompletion.model_validate(whole).choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [e.token for e in content] == ["h", "i"]
    assert [len(e.top_logprobs) for e in content] == [1, 1] and content[0].bytes == [104]
    assert merged_chat(streamed)[0]["lp"] == whole["choices"][0]["logprobs"]["content"]


def test_n_choices_keep_their_index_and_finish() -> None:
    chunks = [TokenChunk(request_id="r1", seq=0, index=1, token_ids=[1], text="b"),
              TokenChunk(request_id="r1", seq=1, index=0, token_ids=[2], text="a", choice_finish_reason="stop"),
              TokenChunk(request_id="r1", seq=2, index=1, token_ids=[3], text="c", choice_finish_reason="length"),
              TokenChunk(request_id="r1", seq=3, finish_reason="stop", usage=USAGE)]
    whole, streamed = run("chat", OutputOptions(n=2), chunks)
    parsed = ChatCompletion.model_validate(whole)
    assert [(c.index, c.message.content, c.finish_reason) for c in parsed.choices] == [(0, "a", "stop"),
                                                                                      (1, "bc", "length")]
    merged = merged_chat(streamed)
    assert {i: (m["content"], m["finish"]) for i, m in merged.items()} == {0: ("a", "stop"), 1: ("bc", "length")}
    roles = [c["index"] for raw in streamed for c in raw["choices"] if c["delta"].get("role")]
    assert roles == [1, 0]  # each choice's role delta opens it


def test_a_named_forced_call_streams_its_arguments() -> None:
    options = OutputOptions(tool_choice="function", tool_name="get_weather")
    chunks = [TokenChunk(request_id="r1", seq=0, token_ids=[1], text='{"city": "Pa'),
              TokenChunk(request_id="r1", seq=1, token_ids=[2], text='ris"}', finish_reason="stop", usage=USAGE)]
    whole, streamed = run("chat", options, chunks)
    message = ChatCompletion.model_validate(whole).choices[0].message
    assert message.content == "" and message.tool_calls is not None
    call = message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')  # type: ignore[union-attr]
    assert call.id == tool_call_id("r1", 0, 0)
    merged = merged_chat(streamed)[0]
    assert merged["calls"] == {0: {"id": call.id, "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert merged["finish"] == whole["choices"][0]["finish_reason"] == "stop"  # vLLM keeps "stop" for a named call


def test_a_required_array_of_calls() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    chunks = [TokenChunk(request_id="r1", seq=0, token_ids=[1], text=text[:17]),
              TokenChunk(request_id="r1", seq=1, token_ids=[2], text=text[17:], finish_reason="stop", usage=USAGE)]
    whole, streamed = run("chat", OutputOptions(tool_choice="required"), chunks)
    choice = ChatCompletion.model_validate(whole).choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
    assert calls == [("a", {"x": 1}), ("b", {})]
    merged = merged_chat(streamed)[0]
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(merged["calls"].items())] == calls
    assert merged["finish"] == "tool_calls"
    # cut by max_tokens: no call (the whole array must be valid, as vLLM reads it)
    cut = [TokenChunk(request_id="r1", seq=0, token_ids=[1], text=text[:20], finish_reason="length", usage=USAGE)]
    assert "tool_calls" not in run("chat", OutputOptions(tool_choice="required"), cut)[0]["choices"][0]["message"]


def test_text_a_parser_holds_sends_no_empty_deltas() -> None:
    """A tool call being written streamed one empty ``content`` delta per token; vLLM's
    server sends nothing until its parser has something (its ``delta_message is None``
    case). Textless tokens of a plain choice still get their progress delta, and held
    tokens that carry logprobs still stream them."""
    text = '[{"name": "a", "parameters": {"x": 1}}]'
    chunks = [TokenChunk(request_id="r1", seq=i, token_ids=[i], text=text[i:i + 1]) for i in range(len(text))]
    chunks.append(TokenChunk(request_id="r1", seq=len(text), finish_reason="stop", usage=USAGE))
    _, streamed = run("chat", OutputOptions(tool_choice="required"), chunks)
    deltas = [c["choices"][0] for c in streamed if c["choices"]]
    assert [d["delta"] for d in deltas] == [
        {"role": "assistant", "content": ""},
        {"tool_calls": [{"index": 0, "id": tool_call_id("r1", 0, 0), "type": "function",
                         "function": {"name": "a", "arguments": '{"x": 1}'}}]},
        {},
    ]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    hermes = [TokenChunk(request_id="r1", seq=0, token_ids=[1], text="<tool_call>"),
              TokenChunk(request_id="r1", seq=1, token_ids=[2], text='{"name": "a", '),
              TokenChunk(request_id="r1", seq=2, token_ids=[3], text='"arguments": {}}</tool_call>',
                         finish_reason="stop", usage=USAGE)]
    _, streamed = run("chat", OutputOptions(tool_choice="auto", tool_parser="hermes"), hermes)
    assert not any(c["choices"][0]["delta"] == {"content": ""} for c in streamed if c["choices"])
    with_lp = [TokenChunk(request_id="r1", seq=i, token_ids=[i], text=text[i:i + 1], logprobs=[lp("x", -0.5)])
               for i in range(len(text))]
    with_lp.append(TokenChunk(request_id="r1", seq=len(text), finish_reason="stop", usage=USAGE))
    _, streamed = run("chat", OutputOptions(tool_choice="required", logprobs=True, top_logprobs=1), with_lp)
    assert len(merged_chat(streamed)[0]["lp"]) == len(text)
    plain = [TokenChunk(request_id="r1", seq=0, token_ids=[1], text="hi"),
             TokenChunk(request_id="r1", seq=1, token_ids=[2], text=""),
             TokenChunk(request_id="r1", seq=2, token_ids=[3], text="!", finish_reason="stop", usage=USAGE)]
    _, streamed = run("chat", OutputOptions(), plain)
    assert [c["choices"][0]["delta"] for c in streamed if c["choices"]][2] == {"content": ""}


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_auto_tool_calls_and_reasoning_through_the_parsers(split: int) -> None:
    text = ('<think>the user wants weather</think>Let me check.<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    pieces = [text[i:i + split] for i in range(0, len(text), split)]
    chunks = [TokenChunk(request_id="r1", seq=i, token_ids=[i], text=p) for i, p in enumerate(pieces)]
    chunks.append(TokenChunk(request_id="r1", seq=len(pieces), finish_reason="stop", usage=USAGE))
    options = OutputOptions(tool_choice="auto", tool_parser="hermes", reasoning_parser="think")
    whole, streamed = run("chat", options, chunks)
    choice = ChatCompletion.model_validate(whole).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert whole["choices"][0]["message"]["reasoning_content"] == "the user wants weather"
    assert choice.message.content == "Let me check."
    call = (choice.message.tool_calls or [])[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
    merged = merged_chat(streamed)[0]
    assert merged["reasoning"] == "the user wants weather" and merged["content"] == "Let me check."
    assert json.loads(merged["calls"][0]["arguments"]) == {"city": "Oslo"} and merged["calls"][0]["id"] == call.id
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    # under both names clients read: vLLM's own (``reasoning``) and its earlier one
    assert whole["choices"][0]["message"]["reasoning"] == "the user wants weather"
    deltas = [c["delta"] for raw in streamed for c in raw["choices"]]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("reasoning") or "" for d in deltas) == "the user wants weather"


def test_replayed_chunks_give_the_same_events() -> None:
    """Resume rebuilds events from JetStream on any gateway: ids and bytes must repeat."""
    chunks = [TokenChunk(request_id="r1", seq=0, token_ids=[1], text='[{"name": "a", "parameters": {}}]',
                         finish_reason="stop", usage=USAGE)]
    options = OutputOptions(tool_choice="required")
    once = [e.data for c in chunks for e in EventBuilder("chat", "r1", "m", 7, False, options).events(c)]
    again = [e.data for c in chunks for e in EventBuilder("chat", "r1", "m", 7, False, options).events(c)]
    assert once == again


def test_prompt_logprobs_as_vllm_answers_them() -> None:
    prompt = [None, TokenLogprob(7, "b", -2.0, [TopLogprob(9, "z", -0.5), TopLogprob(7, "b", -2.0)], 2)]
    chunks = [TokenChunk(request_id="r1", seq=0, token_ids=[1], text="x", prompt_logprobs=prompt,
                         finish_reason="stop", usage=USAGE)]
    chat, _ = run("chat", OutputOptions(prompt_logprobs=True), chunks)
    assert chat["prompt_logprobs"] == [None, {
        "7": {"logprob": -2.0, "rank": 2, "decoded_token": "b"},  # the prompt token first
        "9": {"logprob": -0.5, "rank": 1, "decoded_token": "z"},
    }]
    completion, _ = run("completion", OutputOptions(prompt_logprobs=True), chunks)
    assert completion["choices"][0]["prompt_logprobs"] == chat["prompt_logprobs"]  # per choice there
    assert "prompt_logprobs" not in run("chat", OutputOptions(), chunks)[0]  # only when asked


HERMES_TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


def hermes_chunks(text: str, split: int = 9) -> list[TokenChunk]:
    pieces = [text[i:i + split] for i in range(0, len(text), split)]
    chunks = [TokenChunk(request_id="r1", seq=i, token_ids=[i], text=p) for i, p in enumerate(pieces)]
    chunks.append(TokenChunk(request_id="r1", seq=len(pieces), finish_reason="stop", usage=USAGE))
    return chunks


def test_parallel_tool_calls_false_answers_the_first_call_only() -> None:
    """vLLM's ``maybe_filter_parallel_tool_calls``: with tool_choice auto the parser finds
    both calls; only index 0 goes out, streamed and whole (it was only applied to the
    forced paths' schema)."""
    options = OutputOptions(tool_choice="auto", tool_parser="hermes", parallel_tool_calls=False)
    whole, streamed = run("chat", options, hermes_chunks(HERMES_TWO_CALLS))
    choice = ChatCompletion.model_validate(whole).choices[0]
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather"]  # type: ignore[union-attr]
    assert choice.finish_reason == "tool_calls"
    merged = merged_chat(streamed)[0]
    assert list(merged["calls"]) == [0] and merged["calls"][0]["name"] == "get_weather"
    both, _ = run("chat", OutputOptions(tool_choice="auto", tool_parser="hermes"), hermes_chunks(HERMES_TWO_CALLS))
    assert len(both["choices"][0]["message"]["tool_calls"]) == 2


def test_a_malformed_call_in_a_whole_answer_is_its_text_as_vllm_answers() -> None:
    """vLLM's hermes parser on the whole output: arguments that are not JSON make the
    output plain content, finish "stop"; a client's json.loads(arguments) failed on
    ours. Streamed, the call went out as it came (as vLLM's stream); cut by max_tokens
    a call keeps its partial arguments (as OpenAI's)."""
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    whole, streamed = run("chat", OutputOptions(tool_choice="auto", tool_parser="hermes"), hermes_chunks(text))
    message = whole["choices"][0]["message"]
    assert message["content"] == text and "tool_calls" not in message
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert merged_chat(streamed)[0]["calls"]  # the stream had announced it
    cut = hermes_chunks(text[:text.index('{"city') + 4])  # the arguments began
    cut[-1] = TokenChunk(request_id="r1", seq=cut[-1].seq, finish_reason="length", usage=USAGE)
    cut_whole, _ = run("chat", OutputOptions(tool_choice="auto", tool_parser="hermes"), cut)
    assert cut_whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_mistral_call_ids_are_nine_alphanumerics_on_every_path() -> None:
    """Mistral's chat templates refuse any other id when the call comes back in the
    history (vLLM's MistralToolCall); the gateway's derived ids overrode the parser's."""
    mistral = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    paths = [
        (OutputOptions(tool_choice="auto", tool_parser="mistral", mistral_call_ids=True), mistral),
        (OutputOptions(tool_choice="function", tool_name="get_weather", mistral_call_ids=True), '{"city": "Paris"}'),
        (OutputOptions(tool_choice="required", mistral_call_ids=True), '[{"name": "get_weather", "parameters": {}}]'),
    ]
    for options, text in paths:
        whole, streamed = run("chat", options, hermes_chunks(text))
        [call] = whole["choices"][0]["message"]["tool_calls"]
        assert len(call["id"]) == 9 and call["id"].isalnum(), (options, call)
        assert merged_chat(streamed)[0]["calls"][0]["id"] == call["id"]
    assert tool_call_id("r1", 0, 0, mistral=True) == tool_call_id("r1", 0, 0, mistral=True)  # replays repeat it
    assert tool_call_id("r1", 0, 0).startswith("call_") and len(tool_call_id("r1", 0, 0)) == 29


def test_a_named_call_opens_with_its_name_and_first_arguments_in_one_entry() -> None:
    options = OutputOptions(tool_choice="function", tool_name="get_weather")
    _, streamed = run("chat", options, hermes_chunks('{"city": "Paris"}', split=5))
    first = next(c["choices"][0]["delta"]["tool_calls"] for c in streamed
                 if c["choices"] and c["choices"][0]["delta"].get("tool_calls"))
    assert first == [{"index": 0, "id": tool_call_id("r1", 0, 0), "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"cit'}}]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk() -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: each chunk carries the prompt and
    the choice's tokens so far (the role chunk 0); the last chunk the request's usage."""
    options = OutputOptions(continuous_usage=True, prompt_tokens=5)
    chunks = [TokenChunk(request_id="r1", seq=0, token_ids=[1, 2], text="hel"),
              TokenChunk(request_id="r1", seq=1, token_ids=[3], text="lo", finish_reason="stop", usage=USAGE)]
    for kind in ("chat", "completion"):
        _, streamed = run(kind, options, chunks)
        usages = [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"], c["usage"]["total_tokens"])
                  for c in streamed if c["choices"]]
        expected = [(5, 0, 5), (5, 2, 7), (5, 3, 8), (5, 3, 8)] if kind == "chat" else [(5, 2, 7), (5, 3, 8)]
        assert usages == expected, kind
        assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["completion_tokens"] == 4
    _, plain = run("chat", OutputOptions(), chunks)
    assert all(c["usage"] is None for c in plain if c["choices"])  # include_usage alone: null until the end


@pytest.mark.parametrize("split", [1, 3, 7, 30, 1000])
def test_a_streamed_chunk_carries_one_entry_per_tool_call(split: int) -> None:
    """A chunk whose text opened a call and carried its first arguments went out as two
    entries of index 0 (the name, then a fragment), where OpenAI and vLLM send one per
    index: a client reading ``tool_calls[0]`` of a chunk lost the fragment."""
    text = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    pieces = [text[i:i + split] for i in range(0, len(text), split)]
    chunks = [TokenChunk(request_id="r1", seq=i, token_ids=[i], text=p) for i, p in enumerate(pieces)]
    chunks.append(TokenChunk(request_id="r1", seq=len(pieces), finish_reason="stop", usage=USAGE))
    whole, streamed = run("chat", OutputOptions(tool_choice="auto", tool_parser="hermes"), chunks)
    for raw in streamed:
        for c in raw["choices"]:
            indices = [call["index"] for call in c["delta"].get("tool_calls") or []]
            assert len(indices) == len(set(indices)), c["delta"]
    calls = merged_chat(streamed)[0]["calls"]
    message = whole["choices"][0]["message"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (call["function"]["name"], json.loads(call["function"]["arguments"])) for call in message["tool_calls"]]
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]


def test_a_batchs_answers_merge_in_prompt_order_with_their_usage_summed() -> None:
    from services.gateway.output import merge_batch

    def answer(texts: list[str], prompt_tokens: int, cached: int) -> bytes:
        return json.dumps({
            "id": "cmpl-x", "object": "text_completion", "created": 7, "model": "m",
            "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": "length"} for i, t in enumerate(texts)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 2 * len(texts),
                      "total_tokens": prompt_tokens + 2 * len(texts), "prompt_tokens_details": {"cached_tokens": cached}},
        }).encode()

    merged = Completion.model_validate_json(merge_batch([answer(["a", "b"], 3, 1), answer(["c", "d"], 5, 0)], 2))
    assert [(c.index, c.text) for c in merged.choices] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert merged.usage is not None
    assert (merged.usage.prompt_tokens, merged.usage.completion_tokens, merged.usage.total_tokens) == (8, 8, 16)
    assert merged.usage.prompt_tokens_details is not None and merged.usage.prompt_tokens_details.cached_tokens == 1
