"""Tool calling's pure part (``services.gateway.tools``) and tools in chat templates.

The expected values were recorded from the reference implementations (they cannot be
imported here: vLLM and transformers live in ``.venv-vllm``): the forced-call schemas from
vLLM 0.32's ``vllm.tool_parsers.utils.get_json_schema_from_tools`` on the same tools
(``ChatCompletionToolsParam``), the parsed ``required`` outputs from the
``TypeAdapter(list[FunctionDefinition])`` step of vLLM's chat server, and the rendered
prompts from transformers 5's ``render_jinja_template`` given vLLM's tool dicts
(``model_dump``) and vLLM's ``_postprocess_messages`` of the same conversation.
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ops.tiny_model import CHAT_TEMPLATE as TINY_CHAT_TEMPLATE
from services.gateway.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from services.gateway.errors import ApiError
from services.gateway.openai_api import ChatMessage
from services.gateway.tools import (
    MAX_TOOLS,
    ToolPlan,
    forced_reply,
    history_fields,
    plan_tools,
)

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
                   "required": ["city"], "$defs": {"unit": {"type": "string", "enum": ["c", "f"]}}}}}
NOW: dict[str, Any] = {"type": "function", "function": {"name": "now", "strict": True}}
ADD: dict[str, Any] = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, NOW, ADD]


def tools() -> list[dict[str, Any]]:
    return copy.deepcopy(TOOLS)


# vLLM: get_json_schema_from_tools("required", tools, parallel_tool_calls=None or True)
VLLM_REQUIRED: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": {"type": "object",
                                       "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
                                       "required": ["city"]}},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["now"]},
                        "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["add"]},
                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                       "required": ["a", "b"]}},
         "required": ["name", "parameters"]},
    ]},
    "$defs": {"unit": {"type": "string", "enum": ["c", "f"]}},
}
# ... with parallel_tool_calls=False: maxItems 1, placed before $defs
VLLM_REQUIRED_SINGLE: dict[str, Any] = {
    "type": "array", "minItems": 1, "items": VLLM_REQUIRED["items"], "maxItems": 1, "$defs": VLLM_REQUIRED["$defs"],
}
# ... tool_choice {"type": "function", "function": {"name": "get_weather"}} and {"name": "now"}
VLLM_NAMED_WEATHER: dict[str, Any] = {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city"], "$defs": {"unit": {"type": "string", "enum": ["c", "f"]}},
}
VLLM_NAMED_NOW: dict[str, Any] = {"type": "object", "properties": {}}
# ... ChatCompletionToolsParam(**tool).model_dump(): what the chat template's ``tools`` holds
VLLM_TOOL_DICTS: list[dict[str, Any]] = [
    WEATHER,
    {"type": "function", "function": {"name": "now", "description": None, "parameters": None, "strict": True}},
    {"type": "function", "function": {"name": "add", "description": None, "parameters": ADD["function"]["parameters"]}},
]


def error(fn: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


def schema_of(plan: ToolPlan) -> dict[str, Any]:
    assert plan.structured is not None and plan.structured.json is not None
    parsed: dict[str, Any] = json.loads(plan.structured.json)
    return parsed


def same_json(a: object, b: object) -> bool:
    """Equal, key order included (the schema text the engine compiles)."""
    return json.dumps(a) == json.dumps(b)


# ------------------------------------------------------------------- the forced schema


def test_required_schema_is_vllms() -> None:
    for parallel in (None, True):
        plan = plan_tools(tools(), "required", parallel)
        assert plan.choice == "required" and plan.forced and plan.parallel_tool_calls
        assert same_json(schema_of(plan), VLLM_REQUIRED)
    single = plan_tools(tools(), "required", False)
    assert not single.parallel_tool_calls
    assert same_json(schema_of(single), VLLM_REQUIRED_SINGLE)


def test_named_schema_is_that_functions_parameters() -> None:
    plan = plan_tools(tools(), {"type": "function", "function": {"name": "get_weather"}})
    assert (plan.choice, plan.function_name, plan.forced) == ("named", "get_weather", True)
    assert same_json(schema_of(plan), VLLM_NAMED_WEATHER)
    # no parameters: still a JSON object; the type may be left out, as vLLM allows
    assert same_json(schema_of(plan_tools(tools(), {"function": {"name": "now"}})), VLLM_NAMED_NOW)


def test_template_tools_are_vllms_dicts_and_requests_are_not_mutated() -> None:
    given = tools()
    for choice in ("none", "auto", "required", {"type": "function", "function": {"name": "add"}}):
        plan = plan_tools(given, choice, tool_parser="hermes")
        assert same_json(plan.tools, VLLM_TOOL_DICTS)  # passed whatever the choice, as vLLM does
    assert given == TOOLS  # hoisting $defs for the schema must not touch the request's (or template's) tools
    assert "$defs" in plan_tools(given, "required").tools[0]["function"]["parameters"]  # type: ignore[index]


def test_unforced_choices_have_no_schema() -> None:
    assert plan_tools(None) == ToolPlan()
    assert plan_tools(None, "none").choice == "none"
    plan = plan_tools(tools(), None, tool_parser="hermes")  # tools without tool_choice: auto
    assert (plan.choice, plan.structured, plan.forced) == ("auto", None, False)
    assert plan_tools(tools(), "none").structured is None


def test_combined_schema_conflicts_are_400s() -> None:
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"u": {"$ref": "#/$defs/unit"}}, "$defs": {"unit": {"type": "integer"}}}}}
    err = error(plan_tools, [WEATHER, other], "required")
    assert err.param == "tools[1].function.parameters" and "unit" in err.message
    # fine when only that function is forced (its own $defs stay inside its schema)
    assert schema_of(plan_tools([WEATHER, other], {"function": {"name": "other"}}))["$defs"] == {"unit": {"type": "integer"}}
    # a reference into the function's own properties cannot survive being moved under the array
    local = {"type": "function", "function": {"name": "loc", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}}}}}
    assert error(plan_tools, [local], "required").param == "tools"


# ------------------------------------------------------------------------ validation

BAD: list[tuple[str, list[Any] | None, Any, Any, str]] = [
    # (why, tools, tool_choice, parallel_tool_calls, param)
    ("empty tools", [], None, None, "tools"),
    ("too many tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)], None, None,
     "tools"),
    ("tool not an object", ["get_weather"], None, None, "tools[0]"),
    ("unknown tool type", [{"type": "code_interpreter", "function": {"name": "x"}}], None, None, "tools[0].type"),
    ("no function", [{"type": "function"}], None, None, "tools[0].function"),
    ("function not an object", [{"type": "function", "function": "x"}], None, None, "tools[0].function"),
    ("no name", [ADD, {"type": "function", "function": {"description": "x"}}], None, None, "tools[1].function.name"),
    ("name not a string", [{"type": "function", "function": {"name": 7}}], None, None, "tools[0].function.name"),
    ("name with a space", [{"type": "function", "function": {"name": "get weather"}}], None, None,
     "tools[0].function.name"),
    ("name with a trailing newline", [{"type": "function", "function": {"name": "add\n"}}], None, None,
     "tools[0].function.name"),
    ("name too long", [{"type": "function", "function": {"name": "x" * 129}}], None, None, "tools[0].function.name"),
    ("empty name", [{"type": "function", "function": {"name": ""}}], None, None, "tools[0].function.name"),
    ("duplicate name", [ADD, NOW, ADD], None, None, "tools[2].function.name"),
    ("description not a string", [{"type": "function", "function": {"name": "x", "description": 1}}], None, None,
     "tools[0].function.description"),
    ("strict not a boolean", [{"type": "function", "function": {"name": "x", "strict": "yes"}}], None, None,
     "tools[0].function.strict"),
    ("parameters not an object", [{"type": "function", "function": {"name": "x", "parameters": []}}], None, None,
     "tools[0].function.parameters"),
    ("parameters not a JSON Schema", [{"type": "function", "function": {"name": "x", "parameters": {"type": "objekt"}}}],
     None, None, "tools[0].function.parameters"),
    ("a $ref that does not resolve", [{"type": "function", "function": {"name": "x", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}], None, None, "tools[0].function.parameters"),
    ("unknown choice", [ADD], "any", None, "tool_choice"),
    ("choice of the wrong type", [ADD], 3, None, "tool_choice"),
    ("choice without tools", None, "required", None, "tool_choice"),
    ("named choice without tools", None, {"type": "function", "function": {"name": "add"}}, None, "tool_choice"),
    ("named choice of another type", [ADD], {"type": "tool", "function": {"name": "add"}}, None, "tool_choice.type"),
    ("named choice without function", [ADD], {"type": "function"}, None, "tool_choice.function"),
    ("named choice, function not an object", [ADD], {"type": "function", "function": "add"}, None,
     "tool_choice.function"),
    ("named choice without a name", [ADD], {"type": "function", "function": {}}, None, "tool_choice.function.name"),
    ("named choice, name not a string", [ADD], {"function": {"name": ["add"]}}, None, "tool_choice.function.name"),
    ("named choice of an undefined function", [ADD], {"type": "function", "function": {"name": "sub"}}, None,
     "tool_choice.function.name"),
    ("parallel_tool_calls not a boolean", [ADD], "required", "no", "parallel_tool_calls"),
]


@pytest.mark.parametrize(("why", "tool_list", "choice", "parallel", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_tool_fields_are_400s_naming_the_parameter(why: str, tool_list: list[Any] | None, choice: Any,
                                                       parallel: Any, param: str) -> None:
    err = error(plan_tools, tool_list, choice, parallel, tool_parser="hermes")
    assert err.param == param, (why, err.message)
    assert err.type == "invalid_request_error" and err.code and err.message


def test_auto_needs_a_tool_parser_but_forced_calls_do_not() -> None:
    for choice in ("auto", None):
        err = error(plan_tools, [ADD], choice)
        assert err.param == "tool_choice" and err.code == "unsupported_value" and "parser" in err.message
    assert plan_tools([ADD], "auto", tool_parser="hermes").choice == "auto"
    assert plan_tools([ADD], "required").forced
    assert plan_tools([ADD], {"type": "function", "function": {"name": "add"}}).forced
    assert plan_tools([ADD], "none").tools is not None  # none: rendered, never parsed


def test_errors_do_not_echo_huge_values() -> None:
    err = error(plan_tools, [{"type": "function", "function": {"name": "x" * 100_000}}])
    assert len(err.message) < 400
    err = error(plan_tools, [ADD], "y" * 100_000)
    assert len(err.message) < 500


# ------------------------------------------------------------- the forced call's output

# vLLM (the required branch of its chat server's tool extraction) on the same texts:
# (text, [(name, arguments)]), an empty list where it finds no valid array.
REQUIRED_OUTPUTS: list[tuple[str, list[tuple[str, str]]]] = [
    ('[{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "c"}}, {"name": "now", "parameters": {}}]',
     [("get_weather", '{"city": "Zürich", "unit": "c"}'), ("now", "{}")]),
    ('[{"name":"add","parameters":{"a":1,"b":2.50}}]', [("add", '{"a": 1, "b": 2.5}')]),
    ('  [ {"name" : "now" , "parameters" : { } } ]  ', [("now", "{}")]),
    ('[{"name":"add"}]', [("add", "null")]),
    ('[{"name":"add","parameters":null}]', [("add", "null")]),
    ("[]", []),
    ('[{"name":"add","parameters":{"a":1', []),  # cut by max_tokens
    ('{"name":"add","parameters":{}}', []),  # not an array
    ('[{"name":3,"parameters":{}}]', []),
]


@pytest.mark.parametrize(("text", "expected"), REQUIRED_OUTPUTS)
def test_required_output_becomes_vllms_tool_calls(text: str, expected: list[tuple[str, str]]) -> None:
    ids = (f"call_{i}" for i in itertools.count())
    reply = forced_reply(plan_tools(tools(), "required"), text, "stop", new_id=lambda: next(ids))
    assert [(c.function.name, c.function.arguments) for c in reply.tool_calls] == expected
    assert [c.id for c in reply.tool_calls] == [f"call_{i}" for i in range(len(expected))]
    assert all(c.type == "function" for c in reply.tool_calls)
    assert reply.content == ""
    assert reply.finish_reason == "tool_calls"  # required + stop, whatever was parsed (vLLM's rule)


def test_required_finish_reasons_and_parallel_false() -> None:
    text = REQUIRED_OUTPUTS[0][0]
    assert forced_reply(plan_tools(tools(), "required"), text, "length").finish_reason == "length"
    single = forced_reply(plan_tools(tools(), "required", False), text, "stop")
    assert [c.function.name for c in single.tool_calls] == ["get_weather"]  # vLLM keeps the first call only


def test_named_output_is_the_arguments() -> None:
    plan = plan_tools(tools(), {"type": "function", "function": {"name": "get_weather"}})
    reply = forced_reply(plan, '{"city": "Zürich"}', "stop", new_id=lambda: "call_x")
    assert [(c.id, c.function.name, c.function.arguments) for c in reply.tool_calls] == \
        [("call_x", "get_weather", '{"city": "Zürich"}')]
    assert (reply.content, reply.finish_reason) == ("", "stop")  # a named call keeps "stop"
    assert forced_reply(plan, " \n", "length").tool_calls == []
    # the text is kept as the model wrote it, even cut short
    assert forced_reply(plan, '{"city": "Zü', "length").tool_calls[0].function.arguments == '{"city": "Zü'


def test_default_ids_are_openai_shaped_and_unforced_plans_are_refused() -> None:
    call = forced_reply(plan_tools([ADD], "required"), '[{"name": "add", "parameters": {"a": 1, "b": 2}}]', "stop")
    assert call.tool_calls[0].id.startswith("call_") and len(call.tool_calls[0].id) == 29
    with pytest.raises(ValueError):
        forced_reply(plan_tools([ADD], "auto", tool_parser="hermes"), "x", "stop")


# ----------------------------------------------------------------------------- history


def message(**fields: Any) -> ChatMessage:
    return msgspec.convert(fields, ChatMessage)


def call(arguments: Any, name: str = "add") -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize(("arguments", "expected"), [
    ('{"a": 1, "b": "ü"}', {"a": 1, "b": "ü"}),
    ("", {}),  # vLLM: empty arguments are {}
    ("{not json", {}),  # malformed history must not make every later turn fail (vLLM coerces)
    ("[1, 2]", {}),  # JSON, but not an object: templates need a mapping
    ("42", {}),
])
def test_history_arguments_become_dicts_as_in_vllm(arguments: str, expected: dict[str, Any]) -> None:
    fields = history_fields(message(role="assistant", content=None, tool_calls=[call(arguments)]), 2)
    assert fields == {"tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "add", "arguments": expected}}]}


def test_history_tool_messages_and_errors() -> None:
    assert history_fields(message(role="tool", content="3", tool_call_id="call_1"), 3) == {"tool_call_id": "call_1"}
    assert history_fields(message(role="assistant", content="hi", tool_calls=[]), 1) == {}  # vLLM drops empty lists
    assert history_fields(message(role="user", content="hi"), 0) == {}
    assert error(history_fields, message(role="tool", content="3"), 4).param == "messages[4].tool_call_id"
    assert error(history_fields, message(role="user", content="x", tool_calls=[call("{}")]), 1).param == \
        "messages[1].tool_calls"


# ------------------------------------------------------------------ rendering with tools
TOOL_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response id="' + message.tool_call_id + '">\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

RENDERED_TOOL = (
    "<|im_start|>system\n"
    "Be brief.\n"
    "\n"
    "# Tools\n"
    "<tools>\n"
    "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather in a city.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"description\": \"Zürich, or <any> city\"}}, \"required\": [\"city\"]}}}\n"
    "{\"type\": \"function\", \"function\": {\"name\": \"now\", \"description\": null, \"parameters\": null}}\n"
    "</tools><|im_end|>\n"
    "<|im_start|>user\n"
    "Weather in Zürich and the time?<|im_end|>\n"
    "<|im_start|>assistant\n"
    "<tool_call>\n"
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n"
    "</tool_call>\n"
    "<tool_call>\n"
    "{\"name\": \"now\", \"arguments\": {}}\n"
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n"
    "<tool_response id=\"call_a\">\n"
    "14 °C, <cloudy>\n"
    "</tool_response>\n"
    "<tool_response id=\"call_b\">\n"
    "12:00\n"
    "</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
    "14 °C at noon.<|im_end|>\n"
    "<|im_start|>user\n"
    "Thanks<|im_end|>\n"
    "<|im_start|>assistant\n"
)

RENDERED_SIM = (
    "<|im_start|>system\n"
    "Be brief.\n"
    "\n"
    "# Tools\n"
    "\n"
    "You may call one or more functions. Their signatures are within <tools></tools>:\n"
    "<tools>\n"
    "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather in a city.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"description\": \"Zürich, or <any> city\"}}, \"required\": [\"city\"]}}}\n"
    "{\"type\": \"function\", \"function\": {\"name\": \"now\", \"description\": null, \"parameters\": null}}\n"
    "</tools>\n"
    "\n"
    "To call a function, reply with a JSON object within <tool_call></tool_call> tags:\n"
    "<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n"
    "Weather in Zürich and the time?<|im_end|>\n"
    "<|im_start|>assistant\n"
    "<tool_call>\n"
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n"
    "</tool_call>\n"
    "<tool_call>\n"
    "{\"name\": \"now\", \"arguments\": {}}\n"
    "</tool_call><|im_end|>\n"
    "<|im_start|>tool\n"
    "<tool_response>\n"
    "14 °C, <cloudy>\n"
    "</tool_response><|im_end|>\n"
    "<|im_start|>tool\n"
    "<tool_response>\n"
    "12:00\n"
    "</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
    "14 °C at noon.<|im_end|>\n"
    "<|im_start|>user\n"
    "Thanks<|im_end|>\n"
    "<|im_start|>assistant\n"
)


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "14 °C, <cloudy>"},
    {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
    {"role": "assistant", "content": "14 °C at noon."},
    {"role": "user", "content": "Thanks"},
]
RECORDED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "Zürich, or <any> city"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}},
]


def template_messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages as the gateway hands them to the template (string content)."""
    out = []
    for i, m in enumerate(msgspec.convert(raw, list[ChatMessage])):
        assert m.content is None or isinstance(m.content, str)
        out.append({"role": m.role, "content": m.content or "", **history_fields(m, i)})
    return out


@pytest.mark.parametrize(("source", "expected"), [
    (TOOL_TEMPLATE, RENDERED_TOOL),  # a model's own tool template
    (None, RENDERED_SIM),  # the sim models' template
], ids=["hf-tool-template", "sim-template"])
def test_tools_render_as_in_transformers(source: str | None, expected: str) -> None:
    plan = plan_tools(copy.deepcopy(RECORDED_TOOLS), "required")
    text = ChatTemplate(source).render(template_messages(CONVERSATION), tools=plan.tools)
    assert text == expected


def test_without_tools_the_sim_template_is_plain_chatml() -> None:
    text = ChatTemplate().render(template_messages(CONVERSATION[:2]), tools=plan_tools(None).tools)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Zürich and the time?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(template_messages(CONVERSATION[1:2]), tools=[]) == \
        "<|im_start|>user\nWeather in Zürich and the time?<|im_end|>\n<|im_start|>assistant\n"


def test_the_sim_template_gives_tools_a_system_turn_of_its_own() -> None:
    text = ChatTemplate().render(template_messages(CONVERSATION[1:2]), tools=plan_tools([ADD], "required").tools)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "add", "description": null, "parameters": {' in text
    assert text.endswith("<|im_start|>user\nWeather in Zürich and the time?<|im_end|>\n<|im_start|>assistant\n")


def test_looping_over_tools_spends_the_render_budget() -> None:
    looping = ChatTemplate("{% for t in tools %}{% for u in tools %}{% for v in tools %}.{% endfor %}{% endfor %}"
                           "{% endfor %}", max_steps=10_000)
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(100)]
    with pytest.raises(ChatTemplateError) as info:
        looping.render([], tools=many)
    assert info.value.reason == "budget"


# recorded: transformers' render_jinja_template(..., continue_final_message=True)
CONTINUED = [
    (None, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is "),  # spacing kept
    (TINY_CHAT_TEMPLATE, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is"),  # the template trims
]


@pytest.mark.parametrize(("source", "expected"), CONTINUED, ids=["sim", "tiny-model"])
def test_continue_final_message_as_in_transformers(source: str | None, expected: str) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is "}]
    template = ChatTemplate(source, bos_token="<|begin_of_text|>")
    assert template.render(messages, add_generation_prompt=False, continue_final_message=True) == expected


def test_continue_final_message_refusals() -> None:
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate().render([], continue_final_message=True)
    assert info.value.reason == "raised"
    dropping = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}{{ 'content' }}")
    with pytest.raises(ChatTemplateError) as info:
        dropping.render([{"role": "user", "content": "Hi"}], continue_final_message=True)
    assert info.value.reason == "raised" and "drops" in info.value.message


# ----------------------------------------------------------------------------- fuzz

_leaves = st.none() | st.booleans() | st.integers(-5, 300) | st.floats(allow_nan=False) | \
    st.text(max_size=12) | st.sampled_from(["function", "none", "auto", "required", "add", "object", "#/$defs/x"])
_json = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["type", "function", "name", "parameters", "description", "strict", "properties", "$defs",
                     "$ref", "required", "items"]) | st.text(max_size=6), inner, max_size=4), max_leaves=16)
_tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]) | _json}, optional={
    "function": st.fixed_dictionaries({}, optional={"name": st.sampled_from(["add", "now", "a b"]) | _json,
                                                    "parameters": _json, "description": _json, "strict": _json})})


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(tool_list=st.none() | st.lists(_tool | _json, max_size=3), choice=_json | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["add", "now"])})}),
    parallel=_json, text=st.text(max_size=40) | st.sampled_from(["[]", '[{"name": "add", "parameters": {}}]', "{}"]))
def test_any_tool_fields_give_a_plan_or_a_400(tool_list: Any, choice: Any, parallel: Any, text: str) -> None:
    try:
        plan = plan_tools(tool_list, choice, parallel, tool_parser="hermes")
    except ApiError as exc:
        assert exc.status == 400 and exc.param
        return
    if plan.forced:
        assert plan.structured is not None and json.loads(plan.structured.json or "")
        reply = forced_reply(plan, text, "stop")
        if plan.choice == "required":
            for call in reply.tool_calls:
                json.loads(call.function.arguments)  # re-serialised: always JSON


def test_history_arguments_nested_past_the_limit_are_a_400_naming_them() -> None:
    # json.loads took ~970 levels, then the chat template's tojson (deeper in the stack)
    # ran out of it: a 500 blamed on the template ("template broken").
    deep = '{"a":' + "[" * 200 + "]" * 200 + "}"
    err = error(history_fields, message(role="assistant", content=None, tool_calls=[call(deep)]), 3)
    assert err.status == 400 and err.param == "messages[3].tool_calls[0].function.arguments"
    ok = '{"a":' + "[" * 60 + "]" * 60 + "}"  # nesting a real tool call might have
    assert history_fields(message(role="assistant", content=None, tool_calls=[call(ok)]), 3)["tool_calls"]


def test_the_tools_of_a_request_share_the_schema_limits() -> None:
    """One tool of 40,000 parameters, or many tools of a few thousand, stalled the gateway
    for everyone (~0.2 ms a subschema, checked twice with ``required``). OpenAI's limits
    hold per schema (a 400-value enum in several tools is fine), and the request's tools
    together hold at most 20,000 subschemas."""
    def tool(name: str, n: int, enum: int = 0) -> dict[str, Any]:
        props: dict[str, Any] = {f"p{i}": {"type": "string"} for i in range(n)}
        if enum:
            props["tz"] = {"type": "string", "enum": [f"zone-{i}" for i in range(enum)]}
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}

    assert plan_tools([tool("a", 3000), tool("b", 3000)], "required").forced
    assert plan_tools([tool(f"t{i}", 3, enum=400) for i in range(3)], "auto", tool_parser="hermes")
    assert plan_tools([tool(f"t{i}", 20) for i in range(128)], "required").forced  # a large real tool set
    with pytest.raises(ApiError) as info:
        plan_tools([tool("a", 5001)], "required")
    assert info.value.status == 400 and info.value.param == "tools[0].function.parameters"
    assert "5,001 object properties, more than the 5,000 allowed" in info.value.message
    with pytest.raises(ApiError) as info:
        plan_tools([tool(f"t{i}", 4500) for i in range(5)], "required")
    assert info.value.param == "tools[4].function.parameters"
    assert "subschemas, more than the 20,000 allowed" in info.value.message


@pytest.mark.parametrize("name", ["github.create_issue", "fs:read_file", "server/tool", "mcp__srv__t", "a" * 128])
def test_mcp_style_tool_names_are_served(name: str) -> None:
    """Names with the dots, colons and slashes of MCP tools were 400s (OpenAI's narrower
    pattern), where vLLM serves them: a client moving from vLLM lost its tools."""
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for choice in ("auto", "required", {"type": "function", "function": {"name": name}}):
        plan = plan_tools([tool], choice, tool_parser="hermes")
        assert plan.choice in ("auto", "required", "named")
