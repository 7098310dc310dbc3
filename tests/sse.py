"""A minimal SSE reader for tests (independent of the gateway's own code)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing

import aiohttp


async def sse_events(response: aiohttp.ClientResponse) -> AsyncGenerator[tuple[str, str], None]:
    """(id, data) of each SSE event as it arrives (benchmarks/chaos.py reads them so too)."""
    event_id, data = "", ""
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data:
            yield event_id, data
            event_id, data = "", ""


async def read_sse(response: aiohttp.ClientResponse, limit: int | None = None) -> list[tuple[str, str]]:
    """(id, data) of each SSE event; stops after ``limit`` events."""
    events: list[tuple[str, str]] = []
    async with aclosing(sse_events(response)) as stream:
        async for event in stream:
            events.append(event)
            if limit is not None and len(events) >= limit:
                break
    return events


def sse_text(events: list[tuple[str, str]], index: int = 0) -> str:
    """The generated text of choice ``index`` of an OpenAI stream (chat deltas or completion texts)."""
    out = []
    for _, data in events:
        if data == "[DONE]":
            continue
        for choice in json.loads(data).get("choices", []):
            if choice.get("index", 0) == index:
                out.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(out)


def sse_usage(events: list[tuple[str, str]]) -> dict | None:
    for _, data in reversed(events):
        if data != "[DONE]" and json.loads(data).get("usage"):
            return json.loads(data)["usage"]
    return None


def check_continued_stream(events: list[tuple[str, str]], reference: str, completion_tokens: int, what: str) -> None:
    """A stream that was moved, paused or resumed on its way reads as the uninterrupted run
    did: each event once, no error, ``[DONE]`` last, the same text and usage."""
    ids = [e for e, _ in events]
    assert len(ids) == len(set(ids)), f"{what}: an event id repeated"
    errors = [data for _, data in events if data != "[DONE]" and _is_error(json.loads(data))]
    assert not errors, f"{what} failed: {errors[:1]}"
    assert events and events[-1][1] == "[DONE]", events[-3:]
    assert sse_text(events) == reference, f"{what}: text differs from the uninterrupted run"
    usage = sse_usage(events)
    assert usage is not None and usage["completion_tokens"] == completion_tokens, usage


def _is_error(event: dict) -> bool:
    """An error event, or a choice that ended in one."""
    return "error" in event or any(c.get("finish_reason") == "error" for c in event.get("choices") or [])
