"""Tool calling, the gateway's pure part: what a request may ask and what a forced call yields.

- ``plan_tools`` checks ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (an
  ``ApiError`` 400 naming the parameter otherwise) and returns a ``ToolPlan``: the tool
  dicts the chat template gets (``apply_chat_template(tools=...)``, in the shape vLLM
  passes) and, for ``required`` or a named function, the guided-decoding JSON schema that
  makes the model's output a parseable call, built exactly as vLLM's
  ``get_json_schema_from_tools`` builds it.
- ``forced_reply`` turns the output of a forced call back into OpenAI ``tool_calls``,
  as vLLM's server does (``required``: the JSON array of ``{name, parameters}``; a named
  function: the whole text is the arguments).
- ``history_fields`` turns an assistant message's ``tool_calls`` and a tool message's
  ``tool_call_id`` into what chat templates expect (arguments as a dict, not JSON text).

Parsing the model's own tool-call format (``tool_choice`` ``auto``) is the parsers' job
(``services.common.parsers``).
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from proto.messages import StructuredOutput
from services.common.structured import (
    MAX_SCHEMA_DEPTH,
    SchemaSize,
    StructuredOutputError,
    check_combined_schema,
    check_json_schema,
    nested_deeper_than,
)

from .errors import bad_request, clip
from .openai_api import ChatMessage, FunctionCall, ToolCall

# OpenAI's pattern (letters, digits, _ and -, up to 64) widened by the dots, colons and
# slashes of MCP tools' names ("github.create_issue", "fs:read", up to 128 as MCP allows),
# which vLLM serves: a client moving from vLLM keeps its tools.
NAME_PATTERN = r"^[a-zA-Z0-9_.:/-]{1,128}$"
_NAME = re.compile(NAME_PATTERN)
MAX_TOOLS = 128  # OpenAI's limit on functions per request

Choice = Literal["none", "auto", "required", "named"]
_CHOICE: dict[str, Choice] = {"none": "none", "auto": "auto", "required": "required"}


def new_tool_call_id() -> str:
    """``call_`` + 24 hex characters: OpenAI's shape of a tool call id."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's checked tool settings.

    ``tools``: the chat template's ``tools`` argument, one ``{"type": "function",
    "function": {"name", "description", "parameters"[, "strict"]}}`` per tool (vLLM's
    ``model_dump`` of them, so templates print the same JSON); None without tools. They
    are passed whatever the choice, ``none`` included, as vLLM does.
    ``choice``: ``none`` (also: no tools), ``auto``, ``required`` or ``named``
    (``function_name`` then names it). ``structured``: the guided decoding that forces
    the call (``required`` and ``named`` only).
    """

    tools: list[dict[str, Any]] | None = None
    choice: Choice = "none"
    function_name: str | None = None
    parallel_tool_calls: bool = True
    structured: StructuredOutput | None = None

    @property
    def forced(self) -> bool:
        """The output is a call by construction (guided decoding), not parsed from free text."""
        return self.choice in ("required", "named")


# ------------------------------------------------------------------------- validation


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _wrong_type(param: str, expected: str, value: object) -> NoReturn:
    raise bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {_type_name(value)} instead.", param, "invalid_type"
    )


def _missing(param: str) -> NoReturn:
    raise bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def _function(tool: object, i: int, size: SchemaSize) -> dict[str, Any]:
    """``tools[i]`` checked; returns its template dict (vLLM's shape)."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        _wrong_type(where, "an object", tool)
    kind = tool.get("type", "function")  # vLLM defaults the type; OpenAI clients always send it
    if kind != "function":
        shown = clip(kind) if isinstance(kind, str) else _type_name(kind)
        raise bad_request(
            f"Invalid value for '{where}.type': {shown!r} is not supported; the only tool type is 'function'.",
            f"{where}.type",
            "unsupported_value",
        )
    function = tool.get("function")
    if function is None:
        _missing(f"{where}.function")
    if not isinstance(function, dict):
        _wrong_type(f"{where}.function", "an object", function)
    name = function.get("name")
    if name is None:
        _missing(f"{where}.function.name")
    if not isinstance(name, str):
        _wrong_type(f"{where}.function.name", "a string", name)
    if not _NAME.fullmatch(name):  # fullmatch: '$' alone would let a trailing newline through
        raise bad_request(
            f"Invalid '{where}.function.name': {clip(name, 80)!r} does not match the pattern '{NAME_PATTERN}'"
            " (1 to 128 letters, digits, and _ - . : /).",
            f"{where}.function.name",
            "invalid_value",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        _wrong_type(f"{where}.function.description", "a string", description)
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        _wrong_type(f"{where}.function.strict", "a boolean", strict)
    parameters = function.get("parameters")
    if parameters is not None:
        param = f"{where}.function.parameters"
        if not isinstance(parameters, dict):
            _wrong_type(param, "a JSON Schema object", parameters)
        try:
            check_json_schema(parameters, param, size)
        except StructuredOutputError as exc:
            raise bad_request(f"Invalid schema for function '{name}': {exc.message}", param,
                              "invalid_function_parameters") from None
    # pydantic's model_dump in vLLM: every field, strict only when set, nothing else.
    out: dict[str, Any] = {"name": name, "description": description, "parameters": copy.deepcopy(parameters)}
    if strict is not None:
        out["strict"] = strict
    return {"type": "function", "function": out}


def _named_choice(tool_choice: dict[str, Any]) -> str:
    kind = tool_choice.get("type", "function")
    if kind != "function":
        shown = clip(kind) if isinstance(kind, str) else _type_name(kind)
        raise bad_request(
            f"Invalid value for 'tool_choice.type': {shown!r} is not supported; use 'function'.",
            "tool_choice.type",
            "unsupported_value",
        )
    function = tool_choice.get("function")
    if function is None:
        _missing("tool_choice.function")
    if not isinstance(function, dict):
        _wrong_type("tool_choice.function", "an object", function)
    name = function.get("name")
    if name is None:
        _missing("tool_choice.function.name")
    if not isinstance(name, str):
        _wrong_type("tool_choice.function.name", "a string", name)
    return name


def plan_tools(
    tools: Sequence[object] | None,
    tool_choice: object = None,
    parallel_tool_calls: object = None,
    *,
    tool_parser: str | None = None,
) -> ToolPlan:
    """Check a chat request's tool fields (decoded JSON) and plan how they are served.

    ``tool_parser`` is the model's tool-call parser (``WorkerInfo.tool_parser``): without
    one, ``auto`` cannot be served (nothing would find the calls in the output) and is a
    400, as in vLLM without ``--tool-call-parser``. ``required`` and a named function need
    no parser: guided decoding makes the output a call. Raises ``ApiError`` 400.
    """
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        _wrong_type("parallel_tool_calls", "a boolean", parallel_tool_calls)
    parallel = parallel_tool_calls is not False  # None is the default: true
    if tools is not None and not isinstance(tools, (list, tuple)):
        _wrong_type("tools", "an array", tools)
    if tools is not None and len(tools) == 0:
        raise bad_request("Invalid 'tools': empty array. Provide at least one tool, or omit 'tools'.", "tools",
                          "empty_array")
    if tools is not None and len(tools) > MAX_TOOLS:
        raise bad_request(f"Invalid 'tools': at most {MAX_TOOLS} tools are allowed, got {len(tools)}.", "tools",
                          "array_above_max_length")
    size = SchemaSize()  # its tools' subschemas, bounded together
    dicts = [_function(tool, i, size) for i, tool in enumerate(tools or ())]
    seen: dict[str, int] = {}
    for i, d in enumerate(dicts):
        name = d["function"]["name"]
        if name in seen:
            raise bad_request(
                f"Invalid 'tools': the function name '{name}' is used by tools[{seen[name]}] and tools[{i}];"
                " names must be unique.",
                f"tools[{i}].function.name",
                "invalid_value",
            )
        seen[name] = i

    if tool_choice is None:
        choice: Choice = "auto" if dicts else "none"
        name = None
    elif isinstance(tool_choice, str):
        if tool_choice not in _CHOICE:
            raise bad_request(
                f"Invalid value for 'tool_choice': {clip(tool_choice)!r}. Supported values are 'none', 'auto',"
                " 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                "tool_choice",
                "invalid_value",
            )
        choice, name = _CHOICE[tool_choice], None
    elif isinstance(tool_choice, dict):
        choice, name = "named", _named_choice(tool_choice)
    else:
        _wrong_type("tool_choice", "a string or an object", tool_choice)

    if choice != "none" and not dicts:
        raise bad_request("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
                          "tool_choice", "invalid_value")
    if choice == "named" and name not in seen:
        raise bad_request(
            f"Invalid value for 'tool_choice': no function named {clip(str(name), 80)!r} is in 'tools'.",
            "tool_choice.function.name",
            "invalid_value",
        )
    if choice == "auto" and not tool_parser:
        raise bad_request(
            "tool_choice 'auto' needs a tool-call parser to find the calls in the model's output, and this model"
            " has none configured: use tool_choice 'required', a named function or 'none'.",
            "tool_choice",
            "unsupported_value",
        )
    structured = _forcing_schema(dicts, choice, name, parallel_tool_calls) if choice in ("required", "named") else None
    return ToolPlan(tools=dicts or None, choice=choice, function_name=name, parallel_tool_calls=parallel,
                    structured=structured)


# ------------------------------------------------------------ the forced call's schema


def _params_or_empty_object(params: dict[str, Any] | None) -> dict[str, Any]:
    # vLLM: empty or missing parameters still constrain the arguments to a JSON object.
    return params if params else {"type": "object", "properties": {}}


def required_schema(tools: Sequence[dict[str, Any]], parallel_tool_calls: bool | None = None) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: required`` over template tool dicts: an array
    (at least one item; at most one when ``parallel_tool_calls`` is false) of
    ``{"name": <a tool's name>, "parameters": <its schema>}``, every tool's ``$defs``
    hoisted to the top. vLLM's ``_get_json_schema_from_tools``, key order included."""
    items: list[dict[str, Any]] = []
    all_defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        function = tool["function"]
        name = function["name"]
        params = copy.deepcopy(function.get("parameters"))
        if params is not None:
            defs = params.pop("$defs", {})
            if not isinstance(defs, dict):
                raise bad_request(f"'$defs' in the parameters of tool '{name}' must be an object.",
                                  f"tools[{i}].function.parameters", "invalid_function_parameters")
            for def_name, def_schema in defs.items():
                if def_name in all_defs and all_defs[def_name] != def_schema:
                    raise bad_request(
                        f"Tool definition '{def_name}' has different schemas in different tools, which forcing a"
                        " call cannot combine.",
                        f"tools[{i}].function.parameters",
                        "invalid_function_parameters",
                    )
                all_defs[def_name] = def_schema
        items.append({
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": _params_or_empty_object(params)},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    # Only an explicit false opts out of parallel calls: None means the default (true).
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if all_defs:
        schema["$defs"] = all_defs
    return schema


def named_schema(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The JSON schema of a named ``tool_choice``: that function's parameters schema."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return _params_or_empty_object(copy.deepcopy(tool["function"].get("parameters")))
    raise KeyError(name)


def _forcing_schema(dicts: list[dict[str, Any]], choice: Choice, name: str | None,
                    parallel_tool_calls: object) -> StructuredOutput:
    if choice == "named":
        assert name is not None
        schema = named_schema(dicts, name)
    else:
        schema = required_schema(dicts, parallel_tool_calls if isinstance(parallel_tool_calls, bool) else None)
    try:
        # Hoisting $defs can leave a tool's own "#/..." references dangling in the
        # combined schema: a 400 here, not an engine failure later.
        text = check_combined_schema(schema, "tools")  # each tool's parameters were checked above
    except StructuredOutputError as exc:
        raise bad_request(f"The tools cannot be combined into one schema to force a call: {exc.message}", "tools",
                          "invalid_function_parameters") from None
    return StructuredOutput(json=text)


# ----------------------------------------------------------- the forced call's output


@dataclass(frozen=True, slots=True)
class ForcedReply:
    """The assistant message of a forced call: ``content`` is "" (vLLM), the calls are
    ``tool_calls`` (empty when the output is not a call, e.g. cut by max_tokens)."""

    content: str
    tool_calls: list[ToolCall]
    finish_reason: str | None


def _parse_required(text: str) -> list[tuple[str, Any]] | None:
    """(name, parameters) of each item of a ``required`` output; None unless all are valid
    (vLLM validates the whole array as ``list[FunctionDefinition]``)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list):
        return None
    calls: list[tuple[str, Any]] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        params = item.get("parameters")
        if params is not None and not isinstance(params, dict):
            return None
        description = item.get("description")
        if description is not None and not isinstance(description, str):
            return None
        calls.append((item["name"], params))
    return calls


def forced_reply(
    plan: ToolPlan,
    text: str,
    finish_reason: str | None,
    *,
    new_id: Callable[[], str] = new_tool_call_id,
) -> ForcedReply:
    """The message for the whole output ``text`` of a forced call (``plan.forced``).

    ``finish_reason`` becomes ``tool_calls`` for ``required`` when the model stopped
    (OpenAI's rule, as vLLM applies it); a named function keeps ``stop``.
    """
    calls: list[ToolCall] = []
    if plan.choice == "named":
        if text.strip():
            assert plan.function_name is not None
            calls.append(ToolCall(id=new_id(), function=FunctionCall(name=plan.function_name, arguments=text)))
    elif plan.choice == "required":
        for name, params in _parse_required(text) or ():
            # vLLM re-serialises the parameters (json.dumps, non-ASCII kept).
            calls.append(ToolCall(id=new_id(), function=FunctionCall(name=name, arguments=json.dumps(
                params, ensure_ascii=False))))
        if not plan.parallel_tool_calls:
            calls = calls[:1]
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    else:
        raise ValueError(f"tool_choice {plan.choice!r} is not forced")
    return ForcedReply(content="", tool_calls=calls, finish_reason=finish_reason)


# -------------------------------------------------------------------------- history


def _arguments(value: object) -> dict[str, Any]:
    """A history call's ``arguments`` as templates want them: a dict.

    vLLM's rule: a dict stays; JSON text of an object is parsed; empty, malformed or
    non-object arguments become ``{}`` (failing would make the conversation unusable
    for every later turn).
    """
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def history_fields(message: ChatMessage, index: int) -> dict[str, Any]:
    """The tool fields of ``messages[index]`` for the chat template, to merge into its dict.

    An assistant message's non-empty ``tool_calls`` become ``{"tool_calls": [{"id",
    "type", "function": {"name", "arguments": dict}}]}``; a ``tool`` message gets its
    ``tool_call_id`` (required, as OpenAI requires it). ApiError 400 for tool calls on
    another role or a tool message without its id.
    """
    out: dict[str, Any] = {}
    calls = message.tool_calls
    if calls:
        if message.role != "assistant":
            raise bad_request(
                f"Invalid 'messages[{index}].tool_calls': only assistant messages carry tool calls.",
                f"messages[{index}].tool_calls",
                "invalid_value",
            )
        rendered = []
        for j, call in enumerate(calls):  # decoding already refused a type other than "function"
            arguments = _arguments(call.function.arguments)
            if nested_deeper_than(arguments, MAX_SCHEMA_DEPTH):  # the template's tojson would run out of stack
                param = f"messages[{index}].tool_calls[{j}].function.arguments"
                raise bad_request(f"Invalid '{param}': nested deeper than {MAX_SCHEMA_DEPTH} levels.", param,
                                  "invalid_value")
            rendered.append({"id": call.id, "type": "function",
                             "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = rendered
    if message.role == "tool":
        if not message.tool_call_id:
            raise bad_request(
                f"Missing required parameter: 'messages[{index}].tool_call_id' (a tool message answers the call"
                " with that id).",
                f"messages[{index}].tool_call_id",
                "missing_required_parameter",
            )
        out["tool_call_id"] = message.tool_call_id
    return out

