"""Request validation and normalisation: raw OpenAI body bytes → ``NormalizedRequest``.

The gateway's HTTP, WebSocket and NATS front doors all funnel through ``parse_request``
(``parse_ws_request`` for a WebSocket message's body), which hands the body to
``parse_chat_request`` (``chat_request``) or ``parse_completion_request`` (here). They
decode strictly, check every field against the model's ``ModelLimits``, render chat
messages with the model's chat template and tokenize exactly once, so admission, router
and worker all see the same token ids and counts.

Contract (fuzzed in tests): for any input bytes the parsers return a
``NormalizedRequest`` or raise ``ApiError`` with a 4xx status — never another
exception. The one exception to "4xx" is a server fault the client cannot cause or fix:
a broken operator chat template or a failing tokenizer gives ``ApiError`` 500.
``ApiError`` and its builders live in ``errors``: this module is "request in".
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import msgspec

from proto.records import OutputOptions

from .chat_request import parse_chat_request
from .errors import bad_request, tokenizer_failed
from .models import ModelSpec
from .normalized import (
    Body,
    NormalizedRequest,
    check_max_tokens,
    decode_body,
    encode_text,
    finish_request,
    resolve_model,
    truncate_prompt,
)
from .openai_api import (
    CompletionRequest,
    RequestKind,
    WsChatRequest,
    WsCompletionRequest,
    completion_request_decoder,
)
from .sampling_fields import check_common, check_count, check_vllm_unserved, invalid, unsupported

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


# ---------------------------------------------------------------------- completions


def _completion_prompt(spec: ModelSpec, prompt: str | list[str | int | list[int]]) -> list[int]:
    vocab = spec.tokenizer.vocab_size
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty.", "prompt", "invalid_value")
        return encode_text(spec, prompt)
    if not prompt:
        raise bad_request("'prompt' must not be empty.", "prompt", "invalid_value")
    if all(isinstance(t, int) for t in prompt):
        ids: list[int] = prompt  # type: ignore[assignment]
    elif len(prompt) == 1 and isinstance(prompt[0], str):
        return _completion_prompt(spec, prompt[0])
    elif len(prompt) == 1 and isinstance(prompt[0], list):
        ids = prompt[0]
        if not ids:
            raise bad_request("'prompt' must not be empty.", "prompt", "invalid_value")
    elif all(isinstance(p, (str, list)) for p in prompt):
        # ``batch_prompts`` splits a batch before this, on the paths that serve one (HTTP).
        raise bad_request(
            f"Batched prompts ({len(prompt)} prompts in one request) are served over HTTP only; send one request"
            " per prompt.",
            "prompt",
            "unsupported_value",
        )
    else:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a list holding one of those.",
            "prompt",
            "invalid_type",
        )
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise bad_request(
                f"Invalid 'prompt': token id {t} at position {i} is outside this model's vocabulary"
                f" (0..{vocab - 1}).",
                "prompt",
                "invalid_value",
            )
    return list(ids)


def _check_completion_unsupported(req: CompletionRequest) -> None:
    # vLLM 0.1x dropped best_of from its V1 engine too; n is the way to ask for choices.
    if req.best_of is not None and req.best_of != (req.n or 1):
        unsupported("best_of", f"best_of={req.best_of} is not supported: use n for several choices.")
    if req.suffix:
        unsupported("suffix", "suffix (insertion) is not supported.")


def _decode_with_specials(spec: ModelSpec, token_ids: list[int]) -> str:
    """``token_ids`` as text, special tokens kept (vLLM decodes an echoed token prompt so)."""
    tokenizer = spec.tokenizer
    try:
        try:
            return tokenizer.decode(token_ids, skip_special_tokens=False)  # type: ignore[call-arg]
        except TypeError:  # a tokenizer without the option has no specials to keep
            return tokenizer.decode(token_ids)
    except Exception as exc:  # a tokenizer bug is ours, not the client's
        raise tokenizer_failed(exc) from None


def _prompt_text(prompt: str | list[str | int | list[int]]) -> str | None:
    """The prompt as the client wrote it, when it is text (a string, or a batch of one)."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


def _completion_output(req: CompletionRequest, spec: ModelSpec, prompt: list[int], common: dict[str, Any],
                       text: str | None = None) -> OutputOptions:
    """``text``: the prompt as the client wrote it (None: token ids, or a prompt truncated)."""
    top = 0
    if req.logprobs is not None:
        top = check_count("logprobs", req.logprobs, spec.limits.max_logprobs)
        common["logprobs"] = top
    echo = None
    if req.echo:
        # As vLLM: a text prompt echoes as written; token ids decode with their special
        # tokens, so the text and the logprobs' tokens and offsets agree.
        echo = text if text is not None else _decode_with_specials(spec, prompt)
    first_token = ""
    if echo is not None and req.logprobs is not None:
        common["prompt_logprobs"] = max(top, common.get("prompt_logprobs", 0))
        first_token = _decode_with_specials(spec, prompt[:1])
    # vLLM answers prompt_logprobs whenever the engine computed them (echo with logprobs too)
    return OutputOptions(n=common.get("n", 1), logprobs=req.logprobs is not None, top_logprobs=top, echo=echo,
                         echo_first_token=first_token, prompt_logprobs="prompt_logprobs" in common and not req.stream)


def parse_completion_request(
    body: Body, models: Mapping[str, ModelSpec], *, allowed_models: Collection[str] | None = None,
    always_streams: bool = False,
) -> NormalizedRequest:
    """Validate a ``/v1/completions`` body; tokenize a string prompt or check token ids.

    Same contract as ``parse_chat_request``.
    """
    req: CompletionRequest = decode_body(completion_request_decoder, body)
    if always_streams:
        req.stream = True
    spec = resolve_model(req.model, models, allowed_models)
    _check_completion_unsupported(req)
    check_vllm_unserved(req, add_special_tokens=True)
    common = check_common(req, spec.limits, spec.tokenizer.vocab_size)
    # max_tokens 0 with echo: the prompt alone (scoring it), as vLLM answers it.
    requested = check_max_tokens("max_tokens", req.max_tokens, spec.limits, allow_zero=bool(req.echo))
    tokens = _completion_prompt(spec, req.prompt)
    prompt = truncate_prompt(req, spec, tokens, requested)
    output = _completion_output(req, spec, prompt, common, _prompt_text(req.prompt) if prompt == tokens else None)
    return finish_request("completion", req, spec, prompt, common, "max_tokens", requested, output)


def parse_request(
    kind: RequestKind, body: Body, models: Mapping[str, ModelSpec], *, allowed_models: Collection[str] | None = None,
    priority_scheduling: bool = False, always_streams: bool = False,
) -> NormalizedRequest:
    """``parse_chat_request`` or ``parse_completion_request`` by ``kind``. A non-zero
    ``priority`` (vLLM's) is refused unless the server schedules by it, as vLLM does under
    fcfs: the mesh schedules by the key's tier, and dropping it silently would hide that."""
    parse = parse_chat_request if kind == "chat" else parse_completion_request
    request = parse(body, models, allowed_models=allowed_models, always_streams=always_streams)
    if request.priority:
        if not priority_scheduling:
            unsupported("priority", f"priority {request.priority} is not offered: this server does not schedule by a"
                                    " request's priority (on meshserve the API key's tier decides).")
        if not _INT32_MIN <= request.priority <= _INT32_MAX:
            invalid("priority", "must fit in a signed 32-bit integer.")
    return request


# A body this large can take its checks (a big schema, many tools, a long conversation's
# template) the better part of a second of pure Python: it is parsed on a thread, so the
# event loop goes on serving every other client meanwhile (the thread yields the GIL every
# few ms); one such parse at a time per loop, so several cannot take the GIL from it at once.
# Size alone misses a small body of many objects: checking a schema against its metaschema
# costs ~0.2 ms per subschema, so 1,000 properties in 33 KB held the loop 0.19 s. Each JSON
# object therefore counts as OBJECT_COST bytes: ~128 objects (~25 ms of schema checks) go to
# the thread, while ordinary requests (a few dozen messages and tools) stay inline.
OFF_LOOP_BYTES = 64 * 1024
OBJECT_COST = 512
_T = TypeVar("_T")
_off_loop_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def parse_cost(body: Body) -> int:
    """The bytes ``body`` weighs against ``OFF_LOOP_BYTES``: its length, each object at
    ``OBJECT_COST`` (a count in C, ~10 µs for 64 KB; a brace inside a string counts too,
    which errs towards the thread)."""
    if isinstance(body, str):
        return len(body) + OBJECT_COST * body.count("{")
    data = body if isinstance(body, (bytes, bytearray)) else bytes(body)
    return len(data) + OBJECT_COST * data.count(b"{")


async def off_loop(cost: int, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)``: inline for a body whose ``cost`` (``parse_cost``) is under
    ``OFF_LOOP_BYTES``, else on a thread, one at a time per loop. The slot is held until the
    thread is done, also when the caller is cancelled (its client gone): the parse runs on,
    and must not run beside another."""
    if cost < OFF_LOOP_BYTES:
        return fn(*args, **kwargs)
    loop = asyncio.get_running_loop()
    gate = _off_loop_gates.get(loop)
    if gate is None:
        gate = _off_loop_gates[loop] = asyncio.Semaphore(1)
    await gate.acquire()
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))

    def done(finished: asyncio.Future[_T]) -> None:
        gate.release()
        if not finished.cancelled():
            finished.exception()  # retrieved: a cancelled caller's outcome is nobody's

    work.add_done_callback(done)
    return await asyncio.shield(work)


async def parse_request_off_loop(
    kind: RequestKind, body: Body, models: Mapping[str, ModelSpec], **options: Any
) -> NormalizedRequest:
    """``parse_request``, on a thread for a body whose ``parse_cost`` reaches ``OFF_LOOP_BYTES``."""
    return await off_loop(parse_cost(body), parse_request, kind, body, models, **options)


def _ws_kind(message: WsChatRequest | WsCompletionRequest) -> RequestKind:
    return "chat" if isinstance(message, WsChatRequest) else "completion"


async def parse_ws_request_off_loop(
    message: WsChatRequest | WsCompletionRequest, models: Mapping[str, ModelSpec], *,
    allowed_models: Collection[str] | None = None,
) -> NormalizedRequest:
    """``parse_ws_request`` off the loop for a large body, as ``parse_request_off_loop``."""
    return await parse_request_off_loop(_ws_kind(message), message.body, models, allowed_models=allowed_models, always_streams=True)


def parse_ws_request(
    message: WsChatRequest | WsCompletionRequest,
    models: Mapping[str, ModelSpec],
    *,
    allowed_models: Collection[str] | None = None,
) -> NormalizedRequest:
    """Validate the body of a WebSocket request; the socket always streams."""
    return parse_request(_ws_kind(message), message.body, models, allowed_models=allowed_models, always_streams=True)


# OpenAI takes up to 2,048 prompts in one completions request; each runs as a request of
# its own here (admitted, placed and billed alone), so a batch is held to what one key
# would reasonably send at once.
MAX_BATCH_PROMPTS = 256


class _PromptOnly(msgspec.Struct):
    prompt: msgspec.Raw = msgspec.Raw(b"")


_prompt_only = msgspec.json.Decoder(_PromptOnly)


def looks_batched(body: Body) -> bool:
    """Whether a completions body's ``prompt`` opens as a batch (a list of strings or lists),
    from the prompt's raw bytes alone: a scan, not a decode, for the usual single prompt."""
    try:
        raw = bytes(_prompt_only.decode(body).prompt).lstrip()
    except (msgspec.DecodeError, RecursionError):
        return False
    return raw.startswith(b"[") and raw[1:].lstrip()[:1] in (b'"', b"[")


def parse_batch(body: Body, models: Mapping[str, ModelSpec], *,
                allowed_models: Collection[str] | None = None) -> list[NormalizedRequest] | None:
    """A batched completions body as one request per prompt (``batch_prompts``), each
    parsed as if sent alone; None when it holds a single prompt."""
    bodies = batch_prompts(body)
    if bodies is None:
        return None
    return [parse_request("completion", b, models, allowed_models=allowed_models) for b in bodies]


async def parse_batch_off_loop(body: Body, models: Mapping[str, ModelSpec], **options: Any) -> list[NormalizedRequest] | None:
    """``parse_batch`` on the parse thread, always: each prompt's parse repeats every other
    field of the body (a schema checked once per prompt), so no weight of the body says
    what the batch costs; batches are rare enough to pay the thread's ~0.2 ms."""
    return await off_loop(OFF_LOOP_BYTES, parse_batch, body, models, **options)


def batch_prompts(body: Body) -> list[bytes] | None:
    """A completions body whose ``prompt`` is a batch (several strings, or several lists of
    token ids) as one body per prompt, in order; None for a single prompt (a string, token
    ids, or a batch of one), which ``parse_completion_request`` takes as it is. Only the
    batch's shape is checked here: each body is then parsed (and refused) on its own."""
    if not looks_batched(body):
        return None
    try:
        fields = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None  # the parser says what is wrong with it
    prompt = fields.get("prompt") if isinstance(fields, dict) else None
    if not isinstance(prompt, list) or len(prompt) < 2 or not all(isinstance(p, (str, list)) for p in prompt):
        return None
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise bad_request(f"Invalid 'prompt': a batch of {len(prompt):,} prompts; at most {MAX_BATCH_PROMPTS} in one"
                          " request.", "prompt", "invalid_value")
    if fields.get("stream"):
        unsupported("stream", "Batched prompts are answered whole: send them without 'stream', or stream one"
                              " request per prompt.")
    return [msgspec.json.encode({**fields, "prompt": p}) for p in prompt]
