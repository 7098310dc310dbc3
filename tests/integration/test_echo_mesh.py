"""A mesh on the echo engine: the stock openai client gets each prompt back, streamed in
chunks of several tokens, and what the engine cannot do is a clear 400."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from ops.up import Mesh
from tests.conftest import running_mesh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("echo"), engine="echo", model="echo", workers=1,
                      worker_args=["--echo-tokens-per-s", "4000"]) as m:
        yield m


def test_the_prompt_comes_back_streamed_in_multi_token_chunks(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key=mesh.dev_key, max_retries=0, timeout=60)
    prompt = "the quick brown fox, "
    stream = client.completions.create(model="echo", prompt=prompt, max_tokens=300, stream=True,
                                       stream_options={"include_usage": True})
    texts: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        texts.extend(c.text for c in chunk.choices if c.text)
    text = "".join(texts)
    assert text == (prompt * 20)[:300]  # byte tokenizer: a token a character
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 300)
    assert len(texts) < 100  # ~40 tokens a chunk at 4000 tokens/s, not one a token

    with pytest.raises(openai.BadRequestError, match="structured outputs"):
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       response_format={"type": "json_object"})
