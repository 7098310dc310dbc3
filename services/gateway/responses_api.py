"""OpenAI's Responses API (``/v1/responses``) as a translation over chat completions (pure).

A Responses request becomes a chat completions body (``plan_chat``), which goes down
the very path ``/v1/chat/completions`` takes (validation, chat template, admission,
router, worker, the reasoning and tool-call parsers); what comes back is translated:
the whole ``chat.completion`` into a Response object (``response_from_chat``), or each
streamed ``chat.completion.chunk`` into Responses' typed SSE events (``ResponseStream``),
both in :mod:`.responses_output`; this module is the request side.
So every chat feature (tools, structured output, logprobs, reasoning) serves Responses
too, and a chat validation error comes back naming the Responses field it came from
(``ChatPlan.api_error``).

Conversation state (``store`` + ``previous_response_id``) is the caller's: a stored
response keeps its conversation (input items, the previous ones included) and its
output; a continuation passes them as ``history``. Instructions never carry over, as
OpenAI documents.

Ids derive from the mesh request id (``resp_<rid>``, ``msg_<rid>_<n>``, ...), so the
streamed and the non-streamed translation of the same generation name the same items.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from msgspec import Struct

from .errors import ApiError, bad_request, clip
from .normalized import decode_object
from .openai_api import REASONING_EFFORTS

RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Reasoning a client that stores nothing (``store: false``) hands back in its next
# request, as Codex and the Agents SDK ask for it. meshserve's is the reasoning text,
# encoded (not encrypted: the same text is the item's content).
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
_REASONING_TOKEN_PREFIX = "meshserve1."
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
_INPUT_ROLES = {"user", "assistant", "system", "developer"}
# vLLM's sampling extensions: the chat path takes them under the same names (and
# refuses or validates them there), so they pass through unchanged rather than being
# silently dropped.
PASSTHROUGH = ("seed", "top_k", "min_p", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
               "spaces_between_special_tokens", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")


# --------------------------------------------------------------------------- request


class ResponsesRequest(Struct, kw_only=True):
    """The fields of a ``POST /v1/responses`` body that meshserve reads; other unknown
    fields are ignored (harmless ones such as ``service_tier``, ``safety_identifier``)."""

    model: str = ""
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: Any = None  # vLLM's, as on chat: checked there (the body below carries it)
    stream: bool | None = None
    truncation: str | None = None
    # Caps calls to built-in tools (web search, file search...); meshserve offers none, so
    # no response can reach it. Checked and echoed.
    max_tool_calls: int | None = None
    # Refused when set: each would change the output and meshserve does not do it.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: list[Any] | None = None
    moderation: Any = None


@dataclass(slots=True)
class ParsedRequest:
    request: ResponsesRequest
    passthrough: dict[str, Any]  # PASSTHROUGH fields present in the body

    @property
    def store(self) -> bool:
        return self.request.store is not False  # OpenAI's default: stored

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)


# Chat completions fields clients send to /v1/responses by mistake: each would change the
# output, so each is a 400 naming the Responses field to use.
_CHAT_ONLY = {"messages": "'input'", "response_format": "'text.format'", "max_tokens": "'max_output_tokens'",
              "max_completion_tokens": "'max_output_tokens'", "n": "one output per response (send n requests)",
              "logprobs": "include ['message.output_text.logprobs'] and 'top_logprobs'"}


def _unsupported(param: str, message: str) -> NoReturn:
    raise bad_request(message, param, "unsupported_parameter")


def _invalid(param: str, message: str, code: str = "invalid_value") -> NoReturn:
    raise bad_request(f"Invalid '{param}': {message}", param, code)


def parse_responses_request(body: bytes | str) -> ParsedRequest:
    """Decode and check a ``/v1/responses`` body; ``ApiError`` 400 naming the field."""
    raw, req = decode_object(body, ResponsesRequest)
    for name, instead in _CHAT_ONLY.items():
        if raw.get(name) is not None:  # a chat field would be ignored here: say what the Responses API calls it
            _unsupported(name, f"'{name}' is a chat completions field; the Responses API takes {instead}.")
    _check(req)
    return ParsedRequest(req, {k: raw[k] for k in PASSTHROUGH if raw.get(k) is not None})


def _check(req: ResponsesRequest) -> None:
    if req.input is None:
        raise bad_request("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    if req.background:
        _unsupported("background", "Background responses are not supported: send the request and read its answer.")
    if req.conversation is not None:
        _unsupported("conversation", "The Conversations API is not supported; use 'previous_response_id'.")
    if req.prompt is not None:
        _unsupported("prompt", "Prompt templates ('prompt') are not supported.")
    if req.max_tool_calls is not None and req.max_tool_calls < 0:
        _invalid("max_tool_calls", f"must be >= 0, got {req.max_tool_calls}.")
    if req.context_management:
        _unsupported("context_management", "context_management (compaction) is not supported.")
    if req.moderation is not None:
        _unsupported("moderation", "moderation is not supported.")
    if req.truncation not in (None, "disabled", "auto"):
        _invalid("truncation", f"{clip(req.truncation)!r} is not one of 'auto', 'disabled'.")
    for name in req.include or []:
        if name not in (LOGPROBS_INCLUDE, ENCRYPTED_REASONING_INCLUDE):
            _unsupported("include", f"include {clip(name)!r} is not supported; only {LOGPROBS_INCLUDE!r} and"
                                    f" {ENCRYPTED_REASONING_INCLUDE!r} are.")
    if req.previous_response_id is not None and not RESPONSE_ID.match(req.previous_response_id):
        _invalid("previous_response_id", f"{clip(req.previous_response_id)!r} is not a response id (resp_...).")
    if req.reasoning is not None:
        effort = req.reasoning.get("effort")
        if effort is not None and (not isinstance(effort, str) or effort not in REASONING_EFFORTS):
            _invalid("reasoning.effort", f"{clip(str(effort))!r} is not one of {', '.join(map(repr, REASONING_EFFORTS))}.")
        for name in ("summary", "generate_summary"):
            if req.reasoning.get(name) is not None:
                _unsupported(f"reasoning.{name}", "Reasoning summaries are not supported; the reasoning text comes as"
                                                  " a 'reasoning' output item.")
    if req.text is not None:
        verbosity = req.text.get("verbosity")
        if verbosity not in (None, "medium"):
            _unsupported("text.verbosity", "Only text.verbosity 'medium' is supported.")
    if req.metadata is not None:
        if len(req.metadata) > MAX_METADATA_PAIRS:
            _invalid("metadata", f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed.")
        for k, v in req.metadata.items():
            if len(k) > MAX_METADATA_KEY:
                _invalid("metadata", f"keys are at most {MAX_METADATA_KEY} characters.")
            if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
                _invalid("metadata", f"values are strings of at most {MAX_METADATA_VALUE} characters.")
    for name in ("temperature", "top_p"):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            _invalid(name, "must be a finite number.")


# --------------------------------------------------------------- request → chat body


def _text_of(parts: Any, param: str, kinds: tuple[str, ...]) -> str:
    """The text of a content string or list of text parts; anything else is a 400."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        _invalid(param, "must be a string or a list of content parts.", "invalid_type")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            _invalid(f"{param}[{j}]", "must be a content part object.", "invalid_type")
        kind = part.get("type")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in kinds:
            raise bad_request(f"Content part type {clip(str(kind))!r} is not supported here: this model takes text"
                              f" ({', '.join(kinds)}).", f"{param}[{j}].type", "unsupported_value")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"Missing required parameter: '{param}[{j}].text'.", f"{param}[{j}].text",
                              "missing_required_parameter")
        texts.append(text)
    # The chat path joins text parts with newlines (as vLLM); the same here.
    return "\n".join(texts)


def _required_str(item: Mapping[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"Missing required parameter: '{param}.{name}'.", f"{param}.{name}", "missing_required_parameter")
    return value


def _messages_from_items(items: list[Any], params: list[str], messages: list[dict[str, Any]],
                         message_params: list[str]) -> None:
    """Append the chat messages of Responses input items (``params[i]`` names item i).

    As vLLM does, a reasoning item, an assistant message and function calls in a row
    make one assistant message (content, ``reasoning``, ``tool_calls``); the reasoning
    reaches the chat template as vLLM gives it (``chat_request.chat_messages``).
    """
    for item, param in zip(items, params, strict=True):
        if not isinstance(item, dict):
            _invalid(param, "must be an input item object.", "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        last = messages[-1] if messages else None
        assistant = last if last is not None and last["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _INPUT_ROLES:
                raise bad_request(f"Invalid value for '{param}.role': {clip(str(role))!r} is not supported; use user,"
                                  " assistant, system or developer.", f"{param}.role", "unsupported_value")
            if "content" not in item:
                raise bad_request(f"Missing required parameter: '{param}.content'.", f"{param}.content",
                                  "missing_required_parameter")
            kinds = ("output_text",) if role == "assistant" else ("input_text",)
            text = _text_of(item["content"], f"{param}.content", (*kinds, "text"))
            if role == "assistant" and assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                continue
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": _required_str(item, "call_id", param), "type": "function",
                    "function": {"name": _required_str(item, "name", param),
                                 "arguments": _required_str(item, "arguments", param)}}
            if assistant is not None:
                assistant.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if output is None:
                raise bad_request(f"Missing required parameter: '{param}.output'.", f"{param}.output",
                                  "missing_required_parameter")
            messages.append({"role": "tool", "tool_call_id": _required_str(item, "call_id", param),
                             "content": _text_of(output, f"{param}.output", ("input_text", "output_text", "text"))})
        elif kind == "reasoning":
            reasoning = ""
            if item.get("content"):
                reasoning = _text_of(item["content"], f"{param}.content", ("reasoning_text",))
            elif item.get("encrypted_content"):
                reasoning = reasoning_from_token(item["encrypted_content"], f"{param}.encrypted_content")
            elif item.get("summary"):  # as vLLM: the summary when there is no content
                reasoning = _text_of(item["summary"], f"{param}.summary", ("summary_text",))
            if assistant is not None and assistant.get("reasoning") is None:
                assistant["reasoning"] = reasoning
                continue
            messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
        else:
            raise bad_request(f"Input item type {clip(str(kind))!r} is not supported; use message, function_call,"
                              " function_call_output or reasoning.", f"{param}.type", "unsupported_value")
        message_params.append(param)


def reasoning_token(text: str) -> str:
    """A reasoning item's ``encrypted_content``: its text, for the client to hand back."""
    return _REASONING_TOKEN_PREFIX + base64.urlsafe_b64encode(text.encode()).decode()


def reasoning_from_token(token: object, param: str) -> str:
    """The reasoning text of an ``encrypted_content`` meshserve made; a 400 for another's."""
    if isinstance(token, str) and token.startswith(_REASONING_TOKEN_PREFIX):
        try:
            return base64.urlsafe_b64decode(token[len(_REASONING_TOKEN_PREFIX):].encode()).decode()
        except ValueError:
            pass
    raise bad_request(f"Invalid value for '{param}': not reasoning this server returned (encrypted reasoning of"
                      " another provider cannot be read here; send the item's 'content' instead).", param,
                      "invalid_value")


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flat function tools → chat's nested ``{"type", "function": {...}}``."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"Tool type {clip(str(tool.get('type')))!r} is not supported: meshserve runs function"
                              " tools only.", f"tools[{i}].type", "unsupported_value")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        if "name" not in function:
            raise bad_request(f"Missing required parameter: 'tools[{i}].name'.", f"tools[{i}].name",
                              "missing_required_parameter")
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any], tools: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    """(chat tool_choice, the tools the model may call)."""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            _invalid("tool_choice", f"{clip(choice)!r} is not one of 'none', 'auto', 'required'.")
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("Missing required parameter: 'tool_choice.name'.", "tool_choice.name",
                              "missing_required_parameter")
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools":
        mode = choice.get("mode")
        allowed = choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            _invalid("tool_choice", "allowed_tools needs 'mode' (auto or required) and a list of 'tools'.")
        named = [t["name"] for t in allowed
                 if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)]
        if len(named) != len(allowed):
            _unsupported("tool_choice.tools", "allowed_tools may name function tools only ({type: function, name}).")
        # Only the allowed tools are offered: the model cannot call the others.
        names = set(named)
        return mode, [t for t in tools if isinstance(t.get("name"), str) and t["name"] in names]
    raise bad_request(f"tool_choice type {clip(str(kind))!r} is not supported: use none, auto, required, a function"
                      " or allowed_tools.", "tool_choice.type", "unsupported_value")


def _chat_response_format(fmt: Any) -> dict[str, Any] | None:
    """``text.format`` → chat ``response_format`` (None: plain text)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        _invalid("text.format", "must be an object.", "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format type {clip(str(kind))!r} is not supported: use text, json_object or json_schema.",
                      "text.format.type", "unsupported_value")


# Chat parameters whose Responses name differs (error params are mapped back).
_CHAT_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "session_id": "prompt_cache_key", "reasoning_effort": "reasoning.effort", "logprobs": "include"}
_INDEXED = re.compile(r"^(?P<name>messages|tools)\[(?P<i>\d+)\](?P<rest>.*)$")


@dataclass(slots=True)
class ChatPlan:
    """A Responses request as a chat completions body, and what maps the answer back."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # history + this request's input items: what a continuation prepends
    message_params: list[str]  # per chat message: the Responses field it came from
    tools: list[dict[str, Any]]  # the Responses tools, echoed in the Response
    tool_choice: Any
    text_format: dict[str, Any]
    logprobs: bool
    tool_params: list[str] = field(default_factory=list)  # per chat tool: the Responses field

    def api_error(self, exc: ApiError) -> ApiError:
        """A chat validation error, its ``param`` renamed to the Responses field."""
        param = exc.param
        if param is None:
            return exc
        indexed = _INDEXED.match(param)
        if indexed:
            i = int(indexed["i"])
            names = self.message_params if indexed["name"] == "messages" else self.tool_params
            rest = indexed["rest"].replace(".function.", ".", 1) if indexed["name"] == "tools" else ""
            param = (names[i] + rest) if i < len(names) else ("input" if indexed["name"] == "messages" else "tools")
        elif param == "messages":  # empty, or past the context length: said of what the client sent
            message = (exc.message.replace("'messages'", "'input'").replace("at least one message", "at least one item")
                       .replace("your messages", "your input").replace("the messages", "the input"))
            return ApiError(exc.status, message, exc.type, "input", exc.code, exc.retry_after)
        elif param.startswith("response_format"):
            param = "text.format" + param[len("response_format"):].replace(".json_schema", "", 1)
        elif param.startswith("tool_choice.function"):  # Responses' named choice is flat
            param = "tool_choice" + param[len("tool_choice.function"):]
        elif param in _CHAT_PARAMS:
            # A field of another name: the message names the one the client sent too
            # ("Invalid 'max_completion_tokens'" read oddly for a max_output_tokens of 0).
            param = _CHAT_PARAMS[param]
            return ApiError(exc.status, exc.message.replace(f"'{exc.param}'", f"'{param}'"), exc.type, param,
                            exc.code, exc.retry_after)
        return ApiError(exc.status, exc.message, exc.type, param, exc.code, exc.retry_after)


def plan_chat(parsed: ParsedRequest, history: list[dict[str, Any]] | None = None) -> ChatPlan:
    """The chat completions body of a Responses request; ``history``: the stored
    conversation and output of ``previous_response_id``. ApiError 400 naming the field."""
    req = parsed.request
    messages: list[dict[str, Any]] = []
    message_params: list[str] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        message_params.append("instructions")
    past = list(history or [])
    _messages_from_items(past, ["previous_response_id"] * len(past), messages, message_params)
    assert req.input is not None  # _check
    if isinstance(req.input, str):
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": req.input}]
        params = ["input"]
    else:
        items = req.input
        params = [f"input[{i}]" for i in range(len(items))]
    _messages_from_items(items, params, messages, message_params)

    body: dict[str, Any] = {"model": req.model, "messages": messages, **parsed.passthrough}
    tools = req.tools or []
    tool_choice: Any = req.tool_choice if req.tool_choice is not None else "auto"
    offered = tools
    if req.tool_choice is not None:
        chat_choice, offered = _chat_tool_choice(req.tool_choice, tools)
        if offered or chat_choice not in ("auto", "none"):
            # Chat refuses a tool_choice without tools; "auto" with none is Responses' own
            # default (which every Response echoes) and "none" asks for nothing.
            body["tool_choice"] = chat_choice
    position = {id(t): i for i, t in enumerate(tools)}  # not tools.index: quadratic over a hostile list
    tool_params = [f"tools[{position[id(t)]}]" for t in offered]
    if offered:
        body["tools"] = _chat_tools(offered)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = (req.text or {}).get("format")
    response_format = _chat_response_format(fmt)
    if response_format is not None:
        body["response_format"] = response_format
    logprobs = LOGPROBS_INCLUDE in (req.include or []) or bool(req.top_logprobs)
    if logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["reasoning_effort"] = effort
    for name in ("temperature", "top_p", "user", "metadata", "cache_salt"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.prompt_cache_key is not None:
        body["session_id"] = req.prompt_cache_key  # the same intent: requests that share it share a replica's cache
    if req.truncation == "auto":
        # As vLLM: the conversation is cut from its start to fit the model (what OpenAI's
        # "auto" drops, whole items, vLLM and meshserve drop as tokens).
        body["truncate_prompt_tokens"] = -1
    if parsed.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return ChatPlan(body=body, conversation=past + items, message_params=message_params, tools=tools,
                    tool_choice=tool_choice, text_format=fmt if isinstance(fmt, dict) else {"type": "text"},
                    logprobs=logprobs, tool_params=tool_params)
