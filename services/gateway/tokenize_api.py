"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, with the gateway's tokenizers.

Clients count tokens with these before they send a request (vLLM's benchmark scripts,
routers, agents trimming history). The answers are the token ids the gateway itself
would send a worker: the same tokenizer, and for the chat form the same chat template
and message handling as ``/v1/chat/completions`` (``validation``).

Shapes as vLLM 0.32 has them (``vllm.entrypoints.serve.tokenize.protocol``):

- completion form ``{model?, prompt, add_special_tokens=true, return_token_strs=false}``;
- chat form ``{model?, messages, add_generation_prompt=true, continue_final_message=false,
  add_special_tokens=false, return_token_strs=false, tools?}``;
- answer ``{count, max_model_len, tokens, token_strs}``;
- ``/detokenize`` ``{model?, tokens}`` → ``{prompt}``, special tokens kept as text.

``model`` may be left out when the key sees exactly one model (vLLM serves one).
Authenticated like every OpenAI route; every error is OpenAI's error JSON.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

import msgspec
from aiohttp import web
from msgspec import Struct

from proto import ApiKeyRecord

from .auth import authenticated
from .chat_request import chat_messages, render_prompt, template_kwargs
from .errors import bad_request, tokenizer_failed
from .http_body import read_body
from .models import ModelSpec
from .normalized import Body, decode_body, model_allowed, resolve_model
from .openai_api import ChatCompletionRequest, ChatMessage, encode_json
from .tools import plan_tools
from .validation import off_loop, parse_cost

if TYPE_CHECKING:
    from .auth import Authenticator
    from .service import GatewayService


class TokenizeCompletionRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(Struct, kw_only=True):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = None  # None: true, but continue_final_message may turn it off
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[Any] | None = None
    # vLLM's other chat-form fields: declared to be refused, not silently ignored.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


_probe = msgspec.json.Decoder(dict[str, msgspec.Raw])
_completion = msgspec.json.Decoder(TokenizeCompletionRequest)
_chat = msgspec.json.Decoder(TokenizeChatRequest)
_detokenize = msgspec.json.Decoder(DetokenizeRequest)


class _Vocabulary(Protocol):
    """What these endpoints need of a tokenizer (``services.common.tokenizer``'s have it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]: ...


def _model(name: str | None, models: Mapping[str, ModelSpec], allowed: Collection[str] | None) -> ModelSpec:
    """The named model, or without a name the only one the key can use."""
    if name is not None:
        return resolve_model(name, models, allowed, needs_replica=False)
    usable = {spec.name: spec for alias, spec in models.items() if model_allowed(alias, spec, allowed)}
    if len(usable) == 1:
        return next(iter(usable.values()))
    served = ", ".join(sorted(usable)) or "none right now"
    raise bad_request(f"You must provide a model parameter: this gateway serves several models ({served}).",
                      "model", "missing_required_parameter")


def parse_tokenize(body: Body) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The completion or the chat form, told apart by ``prompt`` / ``messages``."""
    fields = decode_body(_probe, body)
    if "messages" in fields and "prompt" in fields:
        raise bad_request("Send either 'prompt' (completion form) or 'messages' (chat form), not both.", "prompt",
                          "invalid_value")
    if "messages" in fields:
        chat: TokenizeChatRequest = decode_body(_chat, body)
        return chat
    if "prompt" not in fields:
        raise bad_request("Missing required parameter: 'prompt' (or 'messages' for a conversation).", "prompt",
                          "missing_required_parameter")
    completion: TokenizeCompletionRequest = decode_body(_completion, body)
    return completion


def _chat_prompt(req: TokenizeChatRequest, spec: ModelSpec) -> str:
    for param in ("chat_template", "mm_processor_kwargs", "media_io_kwargs"):
        if getattr(req, param):
            # vLLM refuses a request's own template too, unless started with --trust-request-chat-template.
            raise bad_request(f"'{param}' is not supported: the model's own chat template renders the messages.",
                              param, "unsupported_parameter")
    if req.continue_final_message and req.add_generation_prompt is not False:
        raise bad_request("Cannot set both 'continue_final_message' and 'add_generation_prompt' to true"
                          " ('add_generation_prompt' defaults to true: set it to false).",
                          "continue_final_message", "invalid_value")
    # The chat path's own message handling, so counts match what /v1/chat/completions sends.
    messages = chat_messages(ChatCompletionRequest(model=spec.name, messages=req.messages))
    # Tools are rendered as given (vLLM's tokenize takes no tool_choice): checked, never forced.
    tools = plan_tools(req.tools, "none").tools
    # chat_template_kwargs as the chat path takes them (enable_thinking: false counts differently).
    return render_prompt(spec, messages, tools, req.add_generation_prompt is not False, req.continue_final_message,
                         template_kwargs(req.chat_template_kwargs), client_variables=bool(req.chat_template_kwargs))


def tokenize(body: Body, models: Mapping[str, ModelSpec], *, allowed_models: Collection[str] | None = None
             ) -> TokenizeResponse:
    """``POST /tokenize``: the token ids of a prompt or a conversation. Raises ``ApiError``."""
    req = parse_tokenize(body)
    spec = _model(req.model, models, allowed_models)
    text = req.prompt if isinstance(req, TokenizeCompletionRequest) else _chat_prompt(req, spec)
    tokenizer = cast(_Vocabulary, spec.tokenizer)
    try:
        ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    except Exception as exc:  # a tokenizer bug is ours, not the client's
        raise tokenizer_failed(exc) from None
    return TokenizeResponse(count=len(ids), max_model_len=spec.limits.max_model_len, tokens=ids, token_strs=strs)


def detokenize(body: Body, models: Mapping[str, ModelSpec], *, allowed_models: Collection[str] | None = None
               ) -> DetokenizeResponse:
    """``POST /detokenize``: the text of token ids, special tokens included (as vLLM's)."""
    req: DetokenizeRequest = decode_body(_detokenize, body)
    spec = _model(req.model, models, allowed_models)
    vocab = spec.tokenizer.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise bad_request(f"Invalid 'tokens': token id {t} at position {i} is outside this model's vocabulary"
                              f" (0..{vocab - 1}).", "tokens", "invalid_value")
    try:
        text = cast(_Vocabulary, spec.tokenizer).decode(req.tokens, skip_special_tokens=False)
    except Exception as exc:
        raise tokenizer_failed(exc) from None
    return DetokenizeResponse(prompt=text)


class TokenizeHttp:
    """The two routes over one gateway's model catalog."""

    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway

    @property
    def auth(self) -> Authenticator:
        return self.gateway.auth

    @authenticated
    async def tokenize(self, http: web.Request, key: ApiKeyRecord) -> web.Response:
        body = await read_body(http, self.gateway.config.max_body_bytes)
        answer = await off_loop(parse_cost(body), tokenize, body, self.gateway.models.specs(), allowed_models=key.models or None)
        return web.Response(body=encode_json(answer), content_type="application/json")

    @authenticated
    async def detokenize(self, http: web.Request, key: ApiKeyRecord) -> web.Response:
        body = await read_body(http, self.gateway.config.max_body_bytes)
        answer = await off_loop(parse_cost(body), detokenize, body, self.gateway.models.specs(),
                                allowed_models=key.models or None)
        return web.Response(body=encode_json(answer), content_type="application/json")


def tokenize_routes(gateway: GatewayService) -> list[web.RouteDef]:
    """``POST /tokenize`` and ``POST /detokenize`` (vLLM's paths: no ``/v1``)."""
    api = TokenizeHttp(gateway)
    return [web.post("/tokenize", api.tokenize), web.post("/detokenize", api.detokenize)]
