"""One trace per request across gateway, admission, router and worker (real processes).

Every service process writes its spans to one JSON-lines file (MESHSERVE_TRACE_FILE, the
runner's file exporter); the test reads them back and checks they form one tree.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ops.up import Mesh
from tests.conftest import running_mesh

MODEL = "sim-llama-8b"


@pytest.fixture
def traced_mesh(tmp_path: Path) -> Iterator[tuple[Mesh, Path]]:
    trace_file = tmp_path / "spans.jsonl"
    with running_mesh(tmp_path / "mesh", workers=1, speed=20.0, extra_env={"MESHSERVE_TRACE_FILE": str(trace_file)}) as m:
        yield m, trace_file


def request_tree(client: openai.OpenAI, trace_file: Path, expected: set[str]) -> tuple[dict[str, dict], object]:
    """Send one completion; its trace's spans by name, each with its parent's name (checked
    to be one tree), and the response."""
    response = client.completions.with_raw_response.create(model=MODEL, prompt="trace me", max_tokens=6)
    request_id = response.headers["X-Request-Id"]
    spans: list[dict] = []
    roots: list[dict] = []
    for _ in range(100):  # exporters in other processes write as spans end
        spans = [json.loads(line) for line in trace_file.read_text().splitlines()] if trace_file.exists() else []
        roots = [s for s in spans if s["name"] == "gateway.request" and s["attributes"].get("meshserve.request_id") == request_id]
        if roots and expected <= {s["name"] for s in spans if s["trace_id"] == roots[0]["trace_id"]}:
            break
        time.sleep(0.1)
    root = roots[0]
    tree = [s for s in spans if s["trace_id"] == root["trace_id"]]
    by_id = {s["span_id"]: s for s in tree}
    # one root, every other span's parent inside the same trace
    assert [s for s in tree if s["parent_span_id"] is None] == [root]
    assert all(s["parent_span_id"] in by_id for s in tree if s is not root)
    names = {s["name"]: {**s, "parent": by_id.get(s["parent_span_id"] or "", {}).get("name")} for s in tree}
    assert expected <= set(names), sorted(names)
    return names, response


def test_one_request_is_one_trace_tree(traced_mesh: tuple[Mesh, Path]) -> None:
    mesh, trace_file = traced_mesh
    client = openai.OpenAI(base_url=mesh.gateway_url + "/v1", api_key=mesh.dev_key, max_retries=0)
    expected = {"gateway.request", "gateway.admission", "admission.check", "gateway.route", "router.route",
                "worker.generate", "worker.queue", "worker.prefill", "worker.decode"}
    names, response = request_tree(client, trace_file, expected)
    assert names["gateway.admission"]["parent"] == "gateway.request" == names["gateway.route"]["parent"]
    assert names["admission.check"]["parent"] == "gateway.admission"  # admission's decision is in the trace
    # placed by the gateway (the first requests, before a router has answered admission),
    # or forwarded by admission
    assert names["router.route"]["parent"] in ("gateway.route", "admission.check")
    assert names["worker.generate"]["parent"] == "router.route"
    for phase in ("worker.queue", "worker.prefill", "worker.decode"):
        assert names[phase]["parent"] == "worker.generate"
    assert {"gateway", "admission", "router", "worker"} <= {s["service"] for s in names.values()}
    worker_span = names["worker.generate"]
    # the sim may sample EOS before max_tokens (no ignore_eos): the span says what the client got
    completion = response.parse()  # type: ignore[attr-defined]
    assert completion.usage is not None and 1 <= completion.usage.completion_tokens <= 6
    assert worker_span["attributes"]["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    gateway_span = names["gateway.request"]["attributes"]
    assert gateway_span["client.address"] == "127.0.0.1"  # who sent it (--trusted-proxy: the forwarded hop)
    assert gateway_span["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    assert gateway_span["gen_ai.operation.name"] == "text_completion"
    assert gateway_span["gen_ai.response.finish_reasons"] == [completion.choices[0].finish_reason]
    # Later requests: admission forwards them to the router itself, under its own span.
    for _ in range(20):
        names, _ = request_tree(client, trace_file, expected - {"gateway.route"})
        if names["router.route"]["parent"] == "admission.check":
            break
    assert names["router.route"]["parent"] == "admission.check", names["router.route"]
    assert names["worker.generate"]["parent"] == "router.route"
