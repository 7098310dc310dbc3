"""OpenAI shapes: strict decoding, response builders checked against the openai SDK's own types."""

from __future__ import annotations

import json

import msgspec
import pytest
from openai.types import Model

from services.gateway import openai_api as api


def test_chat_request_round_trips() -> None:
    body = {
        "model": "sim",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "hello", "name": "bot"},
        ],
        "max_tokens": 5,
        "max_completion_tokens": 6,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["\n", "END"],
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": -0.1,
        "user": "u1",
        "top_k": 40,
        "min_tokens": 2,
        "ignore_eos": True,
        "repetition_penalty": 1.1,
        "session_id": "s1",
    }
    req = api.chat_request_decoder.decode(json.dumps(body).encode())
    assert req.messages[1].content == [api.ContentPart(type="text", text="hi"), api.ContentPart(type="text", text="there")]
    assert req.stream_options == api.StreamOptions(include_usage=True)
    assert req.max_completion_tokens == 6 and req.top_k == 40 and req.session_id == "s1"
    again = api.chat_request_decoder.decode(msgspec.json.encode(req))
    assert again == req


def test_completion_request_accepts_every_prompt_shape() -> None:
    dec = api.completion_request_decoder
    assert dec.decode(b'{"model":"m","prompt":"abc"}').prompt == "abc"
    assert dec.decode(b'{"model":"m","prompt":[1,2,3]}').prompt == [1, 2, 3]
    assert dec.decode(b'{"model":"m","prompt":["abc"]}').prompt == ["abc"]
    assert dec.decode(b'{"model":"m","prompt":[[1,2]]}').prompt == [[1, 2]]


def test_decoding_is_strict_about_types_but_takes_ints_as_floats() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"\$\.max_tokens"):
        api.chat_request_decoder.decode(b'{"model":"m","messages":[],"max_tokens":"5"}')
    with pytest.raises(msgspec.ValidationError, match=r"\$\.stream"):
        api.chat_request_decoder.decode(b'{"model":"m","messages":[],"stream":1}')
    req = api.chat_request_decoder.decode(b'{"model":"m","messages":[],"temperature":1,"n":null}')
    assert req.temperature == 1.0 and isinstance(req.temperature, float) and req.n is None


def test_unknown_fields_are_ignored() -> None:
    req = api.chat_request_decoder.decode(b'{"model":"m","messages":[],"store":true,"metadata":{"a":"b"}}')
    assert req.model == "m"


def test_model_list_shape() -> None:
    models = api.ModelList(data=[api.ModelCard(id="sim", created=1, max_model_len=4096), api.ModelCard(id="b", created=2)])
    raw = json.loads(api.encode_json(models))
    assert raw["object"] == "list"
    assert raw["data"][0] == {"id": "sim", "object": "model", "created": 1, "owned_by": "meshserve", "max_model_len": 4096,
                              "root": None, "parent": None}  # vLLM's cards carry both, always
    assert "max_model_len" not in raw["data"][1]
    assert Model.model_validate(raw["data"][1]).id == "b"


def test_error_body_shape() -> None:
    raw = json.loads(api.error_json("bad", "invalid_request_error", "max_tokens", "invalid_value"))
    assert raw == {"error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}}


def test_ids_are_openai_style() -> None:
    rid = api.new_request_id()
    assert len(rid) == 24 and rid != api.new_request_id()
    assert api.response_id("chat", rid) == f"chatcmpl-{rid}"
    assert api.response_id("completion", rid) == f"cmpl-{rid}"


def test_sse_framing() -> None:
    assert api.sse_event("r1:0", b'{"a":1}') == b'id: r1:0\ndata: {"a":1}\n\n'
    assert api.sse_data(b"{}") == b"data: {}\n\n"
    assert api.SSE_DONE == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        api.sse_event("bad\nid", b"{}")
    # msgspec JSON never contains a raw newline, so any text is safe inside one data line
    frame = api.sse_event("1", api.encode_json({"content": "line1\nline2\r\n"}))
    assert frame.count(b"\n") == 3


def test_ws_client_messages_decode_by_type() -> None:
    dec = api.ws_client_decoder
    auth = dec.decode(b'{"type":"auth","api_key":"msk-x"}')
    assert auth == api.WsAuth(api_key="msk-x")
    chat = dec.decode(b'{"type":"chat.completion","id":"c1","body":{"model":"m","messages":[]}}')
    assert isinstance(chat, api.WsChatRequest) and chat.id == "c1"
    assert msgspec.json.decode(chat.body) == {"model": "m", "messages": []}
    comp = dec.decode(b'{"type":"completion","id":"c2","body":{"model":"m","prompt":"x"}}')
    assert isinstance(comp, api.WsCompletionRequest)
    assert dec.decode(b'{"type":"cancel","id":"c1"}') == api.WsCancel(id="c1")
    with pytest.raises(msgspec.ValidationError):
        dec.decode(b'{"type":"nope","id":"c1"}')


def test_ws_server_messages() -> None:
    assert json.loads(api.ws_token("c1", 0, "hi", [1, 2])) == {
        "type": "token", "id": "c1", "seq": 0, "text": "hi", "token_ids": [1, 2]
    }
    done = json.loads(api.ws_done("c1", "stop", api.usage(3, 2)))
    assert done["type"] == "done" and done["finish_reason"] == "stop" and done["usage"]["total_tokens"] == 5
    err = json.loads(api.ws_error("c1", 429, api.ErrorBody(message="slow down", type="requests"), 2.5))
    assert err == {
        "type": "error",
        "id": "c1",
        "status": 429,
        "error": {"message": "slow down", "type": "requests", "param": None, "code": None},
        "retry_after": 2.5,
    }


def test_tokens_without_text_still_stream_an_empty_delta() -> None:
    """As vLLM does: special tokens or an unfinished UTF-8 sequence render no text, but the
    client still gets a delta per token chunk (and the gateway a write that shows a gone client)."""
    from proto.messages import TokenChunk
    from services.gateway.events import EventBuilder

    for kind in ("chat", "completion"):
        builder = EventBuilder(kind, "r1", "m", 0, include_usage=False)
        first = builder.events(TokenChunk(request_id="r1", seq=0, token_ids=[7]), first=True)
        silent = builder.events(TokenChunk(request_id="r1", seq=1, token_ids=[]), first=False)
        last = builder.events(TokenChunk(request_id="r1", seq=2, token_ids=[9], finish_reason="length"), first=False)
        assert len(first) == (2 if kind == "chat" else 1)  # chat's role delta comes first
        choice = json.loads(first[-1].data)["choices"][0]
        assert (choice["delta"]["content"] if kind == "chat" else choice["text"]) == ""
        assert silent == []  # nothing generated, nothing sent
        assert [e.data for e in last][-1] == b"[DONE]"
        assert len(last) == 2  # the finish chunk carries it: no empty delta before it
