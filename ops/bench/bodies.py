"""OpenAI request bodies for one turn of a session (pure).

Every request streams, asks for the usage chunk, sets ``max_tokens`` with
``ignore_eos`` (a vLLM extension meshserve honours) so outputs are as long as asked,
and carries a per-request ``seed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ops.bench.workload import Session

APIS = ("chat", "completions")


def build_body(
    api: str,
    model: str,
    session: Session,
    k: int,
    *,
    ignore_eos: bool = True,
    continuous_usage: bool = False,
    history: Sequence[str | None] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The body of turn ``k``; ``history[j]`` replaces turn j's synthetic reply if set."""
    turn = session.turns[k]
    replies = [
        (history[j] if history is not None and j < len(history) and history[j] is not None
         else session.turns[j].reply)
        for j in range(k)
    ]
    body: dict[str, Any] = {"model": model}
    if api == "chat":
        messages: list[dict[str, str]] = []
        if session.system:
            messages.append({"role": "system", "content": session.system})
        for j in range(k):
            messages.append({"role": "user", "content": session.turns[j].user})
            messages.append({"role": "assistant", "content": replies[j] or ""})
        messages.append({"role": "user", "content": turn.user})
        body["messages"] = messages
    elif api == "completions":
        parts = [session.system]
        for j in range(k):
            parts += [session.turns[j].user, replies[j] or ""]
        parts.append(turn.user)
        body["prompt"] = "".join(parts)
    else:
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    body["max_tokens"] = turn.output_tokens
    body["stream"] = True
    stream_options: dict[str, bool] = {"include_usage": True}
    if continuous_usage:
        stream_options["continuous_usage_stats"] = True
    body["stream_options"] = stream_options
    if ignore_eos:
        body["ignore_eos"] = True
    body["seed"] = session.seed + k
    if extra:
        body.update(extra)
    return body
