"""Tool-call and reasoning parsers (services/gateway/parsers): recorded model outputs per
format, whole-text results, and the same outputs streamed in pieces of every size, which
must reassemble to exactly the whole-text result."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ContentDelta,
    FunctionCall,
    FunctionCallDelta,
    ReasoningDelta,
    ThinkReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolEvent,
    assemble,
    reasoning_parser,
    tool_parser,
)
from services.common.parsers.jsonstream import JsonStream


def ids() -> Iterator[str]:
    return (f"call_{i}" for i in itertools.count())


def make(name: str) -> ToolCallParser:
    counter = ids()
    return tool_parser(name, id_factory=lambda: next(counter))


def call(i: int, name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{i}", function=FunctionCall(name=name, arguments=arguments))


def stream(parser: ToolCallParser, pieces: list[str]) -> list[ToolEvent]:
    events: list[ToolEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


# ------------------------------------------------------------ recorded outputs per format

# (parser, model output, expected content, expected calls as (name, arguments))
RECORDED: list[tuple[str, str, str | None, list[tuple[str, str]]]] = [
    # Qwen2.5-7B-Instruct, two parallel calls (the shape of Qwen's function-calling docs).
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
        '"date": "2024-10-01", "unit": "celsius"}}\n</tool_call>',
        None,
        [
            ("get_current_temperature", '{"location": "San Francisco, CA, USA"}'),
            (
                "get_temperature_date",
                '{"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"}',
            ),
        ],
    ),
    # Hermes-2-Pro: content before the call, compact JSON, escapes and non-ASCII.
    (
        "hermes",
        "I'll look that up for you.\n<tool_call>\n"
        '{"arguments":{"query":"caf\\u00e9s near \\"Gare du Nord\\"\\nopen now","limit":5,"ratio":1.50,'
        '"tags":["☕","\\ud83d\\ude00"],"strict":false,"cursor":null},"name":"search_places"}\n</tool_call>',
        "I'll look that up for you.\n",
        [
            (
                "search_places",
                '{"query": "cafés near \\"Gare du Nord\\"\\nopen now", "limit": 5, "ratio": 1.5, '
                '"tags": ["☕", "😀"], "strict": false, "cursor": null}',
            )
        ],
    ),
    # Plain answer, no call; it mentions a tag-like "<tool" at the end.
    ("hermes", "The capital of France is Paris. Use <tool", "The capital of France is Paris. Use <tool", []),
    # Not JSON inside the block: the whole output stays content (as vLLM does).
    (
        "hermes",
        'Checking.\n<tool_call>\nget_weather(city="Paris")\n</tool_call>',
        'Checking.\n<tool_call>\nget_weather(city="Paris")\n</tool_call>',
        [],
    ),
    # Single quotes (Python dict, not JSON): content.
    (
        "hermes",
        "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>",
        "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>",
        [],
    ),
    # No "arguments" key: not a call.
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather"}\n</tool_call>',
        [],
    ),
    # Cut off by max_tokens inside the arguments: the call, with the arguments generated.
    (
        "hermes",
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.txt", "text": "Hello, wor',
        None,
        [("write_file", '{"path": "a.txt", "text": "Hello, wor')],
    ),
    # Cut off before the arguments began: content.
    ("hermes", '<tool_call>\n{"name": "write_fi', '<tool_call>\n{"name": "write_fi', []),
    # Text after the first call is not content (vLLM returns the content before it).
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call> and some trailing words',
        None,
        [("f", "{}")],
    ),
    # Llama 3.1 8B Instruct, built-in style with <|python_tag|>.
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
        '"unit": "Fahrenheit"}}',
        None,
        [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')],
    ),
    # Llama 3.2 3B Instruct: bare JSON, two calls separated by "; ".
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 3}}; '
        '{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}',
        None,
        [("get_weather", '{"city": "Tokyo", "days": 3}'), ("get_time", '{"timezone": "Asia/Tokyo"}')],
    ),
    # Content, then the tag.
    (
        "llama3_json",
        'Let me check that. <|python_tag|>{"name": "lookup", "parameters": {"q": "llamas"}}',
        "Let me check that. ",
        [("lookup", '{"q": "llamas"}')],
    ),
    # A JSON answer that is not a call; a plain answer.
    ("llama3_json", '{"answer": 42, "unit": "apples"}', '{"answer": 42, "unit": "apples"}', []),
    ("llama3_json", "  Llamas are camelids.", "  Llamas are camelids.", []),
    # Broken JSON right at the start: content.
    (
        "llama3_json",
        '{"name": get_weather, "parameters": {}}',
        '{"name": get_weather, "parameters": {}}',
        [],
    ),
    # Mistral-7B-Instruct-v0.3, two calls.
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
        '"format": "celsius"}}, {"name": "get_n_day_weather_forecast", "arguments": {"location": '
        '"Paris, France", "format": "celsius", "num_days": 5}}]',
        None,
        [
            ("get_current_weather", '{"location": "Paris, France", "format": "celsius"}'),
            (
                "get_n_day_weather_forecast",
                '{"location": "Paris, France", "format": "celsius", "num_days": 5}',
            ),
        ],
    ),
    # Content before the marker; string arguments kept as they are (vLLM); no arguments → "{}".
    (
        "mistral",
        'Sure, one moment.[TOOL_CALLS][{"name": "run", "arguments": "{\\"cmd\\": \\"ls -la\\"}"}, {"name": "now"}]',
        "Sure, one moment.",
        [("run", '{"cmd": "ls -la"}'), ("now", "{}")],
    ),
    # v11+ tokenizers (Mistral Small 3.x): [TOOL_CALLS]name[ARGS]{...} per call.
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz":"CET"}',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')],
    ),
    (  # MCP-style names (colons, slashes, dots) are tools' names too
        "mistral",
        '[TOOL_CALLS]fs:read[ARGS]{"path": "/a"}[TOOL_CALLS]gh/issues.create[ARGS]{}',
        None,
        [("fs:read", '{"path": "/a"}'), ("gh/issues.create", "{}")],
    ),
    # Not JSON after the marker; an empty list of calls.
    ("mistral", "[TOOL_CALLS] I cannot call tools.", "[TOOL_CALLS] I cannot call tools.", []),
    ("mistral", "[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ("mistral", "Bonjour ! Comment puis-je aider ?", "Bonjour ! Comment puis-je aider ?", []),
]


def recorded_id(case: tuple[str, str, str | None, list[tuple[str, str]]]) -> str:
    return f"{case[0]}:{case[1][:30]}"


@pytest.mark.parametrize("case", RECORDED, ids=recorded_id)
def test_recorded_output_whole_text(case: tuple[str, str, str | None, list[tuple[str, str]]]) -> None:
    name, text, content, calls = case
    assert make(name).parse(text) == (content, [call(i, n, a) for i, (n, a) in enumerate(calls)])


@pytest.mark.parametrize("case", RECORDED, ids=recorded_id)
def test_recorded_output_streamed_in_pieces_of_every_size(
    case: tuple[str, str, str | None, list[tuple[str, str]]],
) -> None:
    name, text, _, _ = case
    whole = make(name).parse(text)
    for size in range(1, len(text) + 1):
        events = stream(make(name), chunks(text, size))
        assert assemble(events) == whole, f"pieces of {size}"
        _check_delta_shapes(events)


def test_recorded_arguments_are_valid_json_when_complete() -> None:
    for _, _, _, calls in RECORDED:
        for n, args in calls:
            if n != "write_file":  # the truncated case
                json.loads(args)


def _check_delta_shapes(events: list[ToolEvent]) -> None:
    """OpenAI's streaming shape: a call's first delta has id, type, name and arguments ""
    and comes before its fragments; fragments have only index and arguments; indexes
    count up from 0."""
    seen: list[int] = []
    for ev in events:
        if isinstance(ev, ContentDelta):
            assert ev.text
            continue
        body = msgspec.json.decode(msgspec.json.encode(ev))
        if ev.index not in seen:
            assert ev.index == len(seen)
            seen.append(ev.index)
            assert set(body) == {"index", "id", "type", "function"}
            assert body["type"] == "function" and body["function"]["arguments"] == ""
            assert isinstance(body["function"]["name"], str)
        else:
            assert body == {"index": ev.index, "function": {"arguments": ev.function.arguments}}
            assert ev.function.arguments


# ------------------------------------------------------------ streaming behaviour


def test_content_streams_at_once_and_only_a_possible_marker_is_held_back() -> None:
    p = make("hermes")
    assert p.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert p.feed("ld <tool_") == [ContentDelta("ld ")]
    assert p.feed("box> done") == [ContentDelta("<tool_box> done")]
    assert p.finish() == []

    m = make("mistral")
    assert m.feed("Voilà [TOOL") == [ContentDelta("Voilà ")]
    assert m.feed("S]") == [ContentDelta("[TOOLS]")]

    ll = make("llama3_json")
    assert ll.feed("Sure <|python") == [ContentDelta("Sure ")]


def test_arguments_stream_while_generated_and_split_tags_do_not_break_deltas() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    p = make("hermes")
    got = [p.feed(ch) for ch in text] + [p.finish()]
    # The name goes out with arguments "" once the arguments begin ...
    first = next(i for i, evs in enumerate(got) if evs)
    assert text[: first + 1].endswith('"arguments": {')
    assert got[first] == [
        ToolCallDelta(
            index=0,
            id="call_0",
            type="function",
            function=FunctionCallDelta(name="get_weather", arguments=""),
        ),
        ToolCallDelta(index=0, function=FunctionCallDelta(arguments="{")),
    ]
    # ... then the arguments arrive a character at a time, before the call is complete.
    fragments = [ev.function.arguments for evs in got for ev in evs if isinstance(ev, ToolCallDelta)]
    assert fragments[0] == "" and fragments[1] == "{"
    assert "".join(fragments) == '{"city": "Paris"}'
    assert len(fragments) > 8


def test_deltas_encode_as_openai_chunks() -> None:
    p = make("hermes")
    events = p.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>') + p.finish()
    encoded = [json.loads(msgspec.json.encode(ev)) for ev in events]
    assert encoded == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a": 1}'}},
    ]
    _, calls = make("hermes").parse('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert json.loads(msgspec.json.encode(calls)) == [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]


def test_whitespace_before_calls_is_not_content() -> None:
    p = make("hermes")
    assert p.feed("\n\n") == []  # could still be plain whitespace content
    events = p.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>') + p.finish()
    assert not any(isinstance(ev, ContentDelta) for ev in events)
    q = make("hermes")
    assert q.feed("\n\n") + q.finish() == [ContentDelta("\n\n")]


def test_parse_does_not_disturb_a_stream_in_progress() -> None:
    p = make("hermes")
    p.feed("<tool_call>")
    assert p.parse("plain") == ("plain", [])
    events = p.feed('{"name": "f", "arguments": {}}') + p.finish()
    assert assemble(events)[1][0].function.name == "f"


def test_default_ids() -> None:
    _, calls = tool_parser("hermes").parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    # Mistral's chat templates refuse tool-call ids that are not 9 alphanumerics.
    _, calls = tool_parser("mistral").parse('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0].id)


def test_feed_after_finish_is_a_programming_error() -> None:
    p = make("hermes")
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")


# ------------------------------------------------------------ properties

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=100, deadline=None)
@given(
    args=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5),
    ensure_ascii=st.booleans(),
    compact=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
)
def test_any_arguments_round_trip_whole_and_streamed(
    args: dict[str, object], ensure_ascii: bool, compact: bool, cuts: list[int]
) -> None:
    """Whatever JSON the model writes (spacing, escapes), arguments are vLLM's
    ``json.dumps(value, ensure_ascii=False)``, and a stream split anywhere agrees."""
    separators = (",", ":") if compact else (", ", ": ")
    body = json.dumps({"name": "fn", "arguments": args}, ensure_ascii=ensure_ascii, separators=separators)
    expected = json.dumps(args, ensure_ascii=False)
    for name, text in (
        ("hermes", f"<tool_call>\n{body}\n</tool_call>"),
        ("llama3_json", body.replace('"arguments"', '"parameters"', 1)),
        ("mistral", f"[TOOL_CALLS][{body}]"),
    ):
        whole = make(name).parse(text)
        assert whole == (None, [call(0, "fn", expected)])
        points = sorted({c % (len(text) + 1) for c in cuts})
        pieces = [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]
        assert assemble(stream(make(name), pieces)) == whole


MARKUP = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "{",
        "}",
        "[",
        "]",
        '"name"',
        '"arguments"',
        '"parameters"',
        ":",
        ",",
        ";",
        '"f"',
        "1",
        '"\\u00e9"',
        " ",
        "\n",
        "x",
        "<tool",
        "[TOOL",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(TOOL_PARSERS),
    parts=st.lists(MARKUP | st.text(max_size=3), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=500), max_size=10),
)
def test_arbitrary_text_never_raises_and_streams_like_whole_text(
    name: str, parts: list[str], cuts: list[int]
) -> None:
    text = "".join(parts)
    whole = make(name).parse(text)
    content, calls = whole
    if not calls:
        assert content == text  # nothing is lost when there is no call
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]
    events = stream(make(name), pieces)
    assert assemble(events) == whole
    _check_delta_shapes(events)


def _build(fmt: str, calls: list[dict[str, object]], content: str) -> str:
    if fmt == "hermes":
        return content + "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)
    if fmt == "llama3_json":
        tag = "<|python_tag|>" if content else ""
        return tag + "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    if fmt == "mistral":
        return content + "[TOOL_CALLS]" + json.dumps(calls)
    # mistral, v11+ form
    return content + "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{json.dumps(c['arguments'])}" for c in calls)


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(["hermes", "llama3_json", "mistral", "mistral_v11"]),
    calls=st.lists(
        st.fixed_dictionaries(
            {
                "name": st.text(alphabet="abc_", min_size=1, max_size=5),
                "arguments": st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=3),
            }
        ),
        min_size=1,
        max_size=3,
    ),
    content=st.sampled_from(["", "Hi. ", "\n"]),
    edit=st.tuples(
        st.integers(min_value=0, max_value=10**6),
        st.sampled_from(["none", "cut", "delete", "insert"]),
        st.sampled_from(list('{}[]",:x \\')),
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=10**6), max_size=8),
)
def test_calls_damaged_anywhere_stream_like_whole_text(
    fmt: str, calls: list[dict[str, object]], content: str, edit: tuple[int, str, str], cuts: list[int]
) -> None:
    """Well-formed outputs of each format give their calls back; the same outputs cut
    short, or with a character deleted or inserted anywhere, never raise, lose no text
    when no call survives, and stream exactly like the whole text however split."""
    text = _build(fmt, calls, content)
    name = "mistral" if fmt == "mistral_v11" else fmt
    at, kind, ch = edit
    at %= len(text) + 1
    if kind == "cut":
        text = text[:at]
    elif kind == "delete":
        text = text[:at] + text[at + 1 :]
    elif kind == "insert":
        text = text[:at] + ch + text[at:]
    whole = make(name).parse(text)
    got_content, got_calls = whole
    if kind == "none":
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == [
            (c["name"], c["arguments"]) for c in calls
        ]
    if not got_calls:
        assert got_content == text
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]
    assert assemble(stream(make(name), pieces)) == whole


JSONISH = st.sampled_from(
    [
        *(
            "{",
            "}",
            "[",
            "]",
            ":",
            ",",
            "1",
            "-",
            "0",
            ".5",
            "e3",
            "01",
            "-0",
            "true",
            "tru",
            "null",
            " ",
            "\n",
        ),
        *('"a"', '"ab', '"x\ty"', '"\\q"', '"\\u00e9"', '"\\ud83d"', '"\\ude00"', '"\\ud83d\\ude00"'),
    ]
)


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(JSONISH, max_size=12))
def test_json_stream_accepts_what_json_loads_accepts(parts: list[str]) -> None:
    """The incremental JSON reader agrees with ``json.loads`` on what is valid, and
    writes what ``json.dumps(..., ensure_ascii=False)`` writes (lone surrogates aside:
    they stay escapes, so the text stays valid UTF-8)."""
    text = "".join(parts)
    try:
        value = json.loads(text)
        valid = True
    except ValueError:
        valid = False
    js = JsonStream()
    pos = js.feed(text)
    js.end()
    out = js.take()
    assert (js.done and not text[pos:].strip()) == valid, text
    lone = re.search(r"\\ud83d(?!\\ude00)|(?<!\\ud83d)\\ude00", text)
    if valid and not lone:
        assert out == json.dumps(value, ensure_ascii=False)


# ------------------------------------------------------------ registry


def test_registry_names_and_unknown_names() -> None:
    assert {"hermes", "llama3_json", "mistral"} <= set(TOOL_PARSERS)
    assert {"think", "deepseek_r1", "qwen3"} <= set(REASONING_PARSERS)
    for name in TOOL_PARSERS:
        assert isinstance(tool_parser(name), ToolCallParser)
    for name in REASONING_PARSERS:
        assert isinstance(reasoning_parser(name), ThinkReasoningParser)
    with pytest.raises(ValueError, match=r"unknown tool parser 'qwen_xml'; known: hermes, llama3_json"):
        tool_parser("qwen_xml")
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'r1'; known: think, deepseek_r1, qwen3"):
        reasoning_parser("r1")


# ------------------------------------------------------------ reasoning

# DeepSeek-R1-Distill-Qwen: the template opens <think> in the prompt; the output closes it.
R1_OUTPUT = "Okay, so I need to add 2 and 2.\nThat makes 4.\n</think>\n\nThe answer is **4**."
# Qwen3 writes both tags.
QWEN3_OUTPUT = (
    "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help you today?"
)

REASONING_RECORDED: list[tuple[str, bool, str | None, str | None]] = [
    (R1_OUTPUT, True, "Okay, so I need to add 2 and 2.\nThat makes 4.\n", "\n\nThe answer is **4**."),
    (
        QWEN3_OUTPUT,
        True,
        "\nThe user greets me. I should greet back.\n",
        "\n\nHello! How can I help you today?",
    ),
    # Cut off while thinking: all reasoning.
    (
        "<think>\nLet me consider the options. First, <thi",
        True,
        "\nLet me consider the options. First, <thi",
        None,
    ),
    # Ends right after the tag.
    ("<think>short</think>", True, "short", None),
    # Thinking turned off for the request: all content, tags included.
    (QWEN3_OUTPUT, False, None, QWEN3_OUTPUT),
    # A stray end tag in the content stays content.
    ("a</think>b</think>c", True, "a", "b</think>c"),
]


@pytest.mark.parametrize("case", REASONING_RECORDED, ids=lambda c: c[0][:25])
def test_reasoning_whole_and_streamed(case: tuple[str, bool, str | None, str | None]) -> None:
    text, thinking, reasoning, content = case
    assert reasoning_parser("deepseek_r1", enable_thinking=thinking).parse(text) == (reasoning, content)
    for size in range(1, len(text) + 1):
        p = reasoning_parser("qwen3", enable_thinking=thinking)
        events = [ev for piece in chunks(text, size) for ev in p.feed(piece)] + p.finish()
        got_r = "".join(ev.text for ev in events if isinstance(ev, ReasoningDelta)) or None
        got_c = "".join(ev.text for ev in events if isinstance(ev, ContentDelta)) or None
        assert (got_r, got_c) == (reasoning, content), f"pieces of {size}"
        assert all(ev.text for ev in events)


def test_reasoning_streams_at_once_and_holds_only_a_possible_tag() -> None:
    p = reasoning_parser("think")
    assert p.feed("Let me think") == [ReasoningDelta("Let me think")]
    assert p.feed(" more </thi") == [ReasoningDelta(" more ")]
    assert p.feed("nk>\n\nAnswer") == [ContentDelta("\n\nAnswer")]
    assert not p.in_reasoning


# Qwen3's vocabulary: "<think>" 151667, "</think>" 151668, both single tokens.
QWEN3_TOKENS: list[tuple[str, int]] = [
    ("<think>", 151667),
    ("\n", 198),
    ("Two", 11613),
    (" plus", 5519),
    (" two", 1378),
    (".", 13),
    ("\n", 198),
    ("</think>", 151668),
    ("\n\n", 271),
    ("4", 19),
    (".", 13),
]


def _feed_tokens(p: ThinkReasoningParser, tokens: list[tuple[str, int]], per_delta: int) -> None:
    for i in range(0, len(tokens), per_delta):
        group = tokens[i : i + per_delta]
        p.feed("".join(t for t, _ in group), [tid for _, tid in group])
    p.finish()


@pytest.mark.parametrize("per_delta", [1, 2, 3, 4, 11])
def test_reasoning_tokens_by_end_token_id_are_exact_however_coalesced(per_delta: int) -> None:
    p = reasoning_parser("qwen3", end_token_id=151668)
    _feed_tokens(p, QWEN3_TOKENS, per_delta)
    assert p.reasoning_tokens == 8  # up to and including </think>


def test_reasoning_tokens_without_the_id_count_deltas_begun_in_reasoning() -> None:
    one = reasoning_parser("think")
    _feed_tokens(one, QWEN3_TOKENS, 1)
    assert one.reasoning_tokens == 8  # single-token deltas: exact
    three = reasoning_parser("think")
    _feed_tokens(three, QWEN3_TOKENS, 3)
    assert three.reasoning_tokens == 9  # the delta [</think>, "\n\n", "4"] counts whole


def test_reasoning_tokens_without_end_tag_and_with_thinking_off() -> None:
    cut = reasoning_parser("think", end_token_id=151668)
    _feed_tokens(cut, QWEN3_TOKENS[:5], 1)
    assert cut.reasoning_tokens == 5
    off = reasoning_parser("think", enable_thinking=False, end_token_id=151668)
    _feed_tokens(off, QWEN3_TOKENS, 1)
    assert off.reasoning_tokens == 0


def test_reasoning_then_tool_calls() -> None:
    """A Qwen3 answer with thinking and a call: the reasoning parser's content is what
    the tool-call parser reads."""
    text = (
        "<think>\nThe user wants the weather in Paris. I'll call get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for size in (1, 2, 5, 17, len(text)):
        r = reasoning_parser("qwen3")
        t = make("hermes")
        reasoning: list[str] = []
        tool_events: list[ToolEvent] = []
        for piece in chunks(text, size):
            for ev in r.feed(piece):
                if isinstance(ev, ReasoningDelta):
                    reasoning.append(ev.text)
                else:
                    tool_events += t.feed(ev.text)
        for ev in r.finish():
            tool_events += t.feed(ev.text)
        tool_events += t.finish()
        assert "".join(reasoning) == "\nThe user wants the weather in Paris. I'll call get_weather.\n"
        assert assemble(tool_events) == (None, [call(0, "get_weather", '{"city": "Paris"}')])


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.sampled_from(["<think>", "</think>", "<th", "</", ">", "a", " ", "\n"]), max_size=20),
    thinking=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_reasoning_split_anywhere_streams_like_whole_text(
    parts: list[str], thinking: bool, cuts: list[int]
) -> None:
    text = "".join(parts)
    whole = reasoning_parser("think", enable_thinking=thinking).parse(text)
    points = sorted({c % (len(text) + 1) for c in cuts})
    p = reasoning_parser("think", enable_thinking=thinking)
    events = [
        ev for a, b in itertools.pairwise([0, *points, len(text)]) for ev in p.feed(text[a:b])
    ] + p.finish()
    got_r = "".join(ev.text for ev in events if isinstance(ev, ReasoningDelta)) or None
    got_c = "".join(ev.text for ev in events if isinstance(ev, ContentDelta)) or None
    assert (got_r, got_c) == whole
    # Nothing but the tags is removed: <think> anywhere in the reasoning, the first </think>.
    end = text.find("</think>")
    if not thinking:
        assert whole == (None, text or None)
    elif end < 0:
        assert whole == (text.replace("<think>", "") or None, None)
    else:
        assert whole == (text[:end].replace("<think>", "") or None, text[end + 8 :] or None)
