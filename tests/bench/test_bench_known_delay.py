"""The bench measures truly: against servers whose delays are known (first token after
200 ms, then one every 20 ms), over HTTP/SSE and over meshserve's NATS protocol.

Tolerances are generous for a noisy shared 2-core machine; the server also logs when
it really sent each token, and the client's view must agree with that closely.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import pytest

from ops.bench import BenchConfig, EndpointConfig, SLOSpec, WorkloadConfig, run_bench
from ops.bench.results import RunResult

# The fakes (tests/bench/conftest.py) are typed loosely here: conftest modules are not
# importable by name in a suite with several of them.
KnownDelayServer = Any

N_OUT = 10


def _config(url: str, *, model: str = "sim", api: str = "chat", n: int = 16, rate: float = 8.0,
            **kw: object) -> BenchConfig:
    defaults: dict[str, object] = dict(
        endpoints=[EndpointConfig(url, label="fake", api=api, model=model, api_key="sk-test")],
        workload=WorkloadConfig(input_tokens="uniform:50:150", output_tokens=str(N_OUT)),
        rates=[rate], num_requests=n, request_timeout=10.0, seed=7,
        slo=SLOSpec(ttft_s=0.5, tpot_s=0.05))
    defaults.update(kw)
    return BenchConfig(**defaults)  # type: ignore[arg-type]


def _check_known_delay(run: RunResult, server: KnownDelayServer, n: int) -> None:
    s = run.summary
    TTFT_S, ITL_S = server.ttft, server.itl
    assert (TTFT_S, ITL_S) == (0.2, 0.02)
    assert s.requests == n and s.ok == n, s.errors
    assert s.ttft_ms.mean is not None and s.tpot_ms.p50 is not None and s.itl_ms.p50 is not None
    # The nominal delays, within the tolerance a noisy machine needs.
    assert abs(s.ttft_ms.mean - TTFT_S * 1000) < 30, s.ttft_ms
    assert abs(s.ttft_ms.p50 - TTFT_S * 1000) < 30, s.ttft_ms  # type: ignore[operator]
    assert abs(s.tpot_ms.p50 - ITL_S * 1000) < 8, s.tpot_ms
    assert abs(s.tpot_ms.mean - ITL_S * 1000) < 8, s.tpot_ms  # type: ignore[operator]
    assert abs(s.itl_ms.p50 - ITL_S * 1000) < 8, s.itl_ms
    for rec in run.requests:
        assert rec.output_tokens == N_OUT and sum(rec.chunk_tokens) == N_OUT
        assert len(rec.itl_s) == N_OUT - 1
        assert rec.prompt_tokens == rec.input_tokens  # exact prompt lengths (byte tokenizer)
    # The client agrees with what the server really did (same perf_counter clock),
    # request by request (paired by their unique seed).
    served = {sv.body["seed"]: sv for sv in server.served}
    workload = WorkloadConfig(input_tokens="uniform:50:150", output_tokens=str(N_OUT)).build(seed=7)
    diffs = []
    for rec in run.requests:
        sv = served[workload.session(rec.session).seed + rec.turn]
        assert rec.ttft_s is not None
        # Client TTFT >= server's time from receipt to first token (the request's trip
        # to the server only adds), and not much more.
        diffs.append(rec.ttft_s - sv.ttft)
    assert min(diffs) > 0, diffs
    assert statistics.median(diffs) < 0.020, diffs
    assert s.slo_attainment == 1.0 and s.slo_holds
    assert not run.client.lagged or run.client.reasons  # a flag always says why
    print(f"\n{run.target}: TTFT mean {s.ttft_ms.mean:.1f} ms p50 {s.ttft_ms.p50:.1f} ms; "
          f"TPOT mean {s.tpot_ms.mean:.2f} ms p50 {s.tpot_ms.p50:.2f} ms; ITL p50 {s.itl_ms.p50:.2f} ms "
          f"p99 {s.itl_ms.p99:.2f} ms; client-minus-server TTFT median "
          f"{statistics.median(diffs) * 1000:.2f} ms; loop lag p99 {run.client.lag_ms.p99:.2f} ms")


async def test_openai_http_known_delay(http_server: KnownDelayServer) -> None:
    result = await run_bench(_config(http_server.base_url))
    (run,) = result.runs
    assert run.mode == "open-loop" and run.arrival == "poisson"
    _check_known_delay(run, http_server, 16)
    first = http_server.served[0]
    assert first.headers["Authorization"] == "Bearer sk-test"
    assert first.body["stream"] is True and first.body["ignore_eos"] is True
    assert first.body["stream_options"] == {"include_usage": True}
    assert first.body["max_tokens"] == N_OUT and isinstance(first.body["seed"], int)
    assert len({r.body["seed"] for r in http_server.served}) == 16


async def test_nats_known_delay(nats_responder: KnownDelayServer, nats_url: str) -> None:
    result = await run_bench(_config(nats_url, api="completions"))
    (run,) = result.runs
    _check_known_delay(run, nats_responder, 16)
    assert nats_responder.served[0].headers["Authorization"] == "Bearer sk-test"
    assert "prompt" in nats_responder.served[0].body


async def test_same_arrivals_and_prompts_on_every_endpoint(http_server: KnownDelayServer,
                                                           nats_responder: KnownDelayServer,
                                                           nats_url: str) -> None:
    cfg = _config(http_server.base_url, n=6, rate=20.0)
    cfg.endpoints = [EndpointConfig(http_server.base_url, label="http", model="sim"),
                     EndpointConfig(nats_url, label="nats", model="sim")]
    result = await run_bench(cfg)
    assert [r.endpoint for r in result.runs] == ["http", "nats"]
    a, b = result.runs
    assert [r.scheduled_s for r in a.requests] == [r.scheduled_s for r in b.requests]
    assert [s.body for s in http_server.served] == [s.body for s in nats_responder.served]


async def test_http_errors_are_counted_by_kind(http_server: KnownDelayServer) -> None:
    result = await run_bench(_config(http_server.base_url, model="err429", n=4, rate=50.0))
    s = result.runs[0].summary
    assert s.ok == 0 and s.errors == {"429": 4}
    rec = result.runs[0].requests[0]
    assert rec.http_status == 429 and rec.error is not None and "slow down" in rec.error
    assert s.slo_attainment == 0.0 and s.goodput == 0.0

    result = await run_bench(_config(http_server.base_url, model="noend", n=2, rate=50.0))
    assert result.runs[0].summary.errors == {"incomplete": 2}


async def test_nats_errors_and_no_responders(nats_responder: KnownDelayServer, nats_url: str) -> None:
    result = await run_bench(_config(nats_url, model="err429", n=3, rate=50.0))
    assert result.runs[0].summary.errors == {"429": 3}
    assert result.runs[0].requests[0].http_status == 429
    cfg = _config(nats_url, n=2, rate=50.0)
    cfg.endpoints[0].root = "nobody"
    result = await run_bench(cfg)
    assert result.runs[0].summary.errors == {"no_responders": 2}


async def test_request_timeout(http_server: KnownDelayServer) -> None:
    result = await run_bench(_config(http_server.base_url, n=2, rate=50.0, request_timeout=0.1))
    assert result.runs[0].summary.errors == {"timeout": 2}


async def test_closed_loop_keeps_concurrency(http_server: KnownDelayServer) -> None:
    result = await run_bench(_config(http_server.base_url, n=6, rates=None, concurrency=[2]))
    (run,) = result.runs
    assert run.mode == "closed-loop" and run.load == "closed-loop c=2"
    assert run.summary.ok == 6
    assert http_server.max_inflight <= 2


async def test_closed_loop_bounded_by_its_duration_alone(http_server: KnownDelayServer) -> None:
    # No request bound: the sessions are planned as the loop takes them, so the run
    # neither refuses to start nor plans prompts it never sends.
    cfg = _config(http_server.base_url, n=6, rates=None, concurrency=[3], duration=0.8, drain_timeout=5.0)
    cfg.num_requests = None
    result = await run_bench(cfg)
    (run,) = result.runs
    # 3 streams of requests that take ≥ 0.38 s (200 ms TTFT + 9 × 20 ms) for 0.8 s of
    # sending: each stream sends 1 to 3 (fewer only on a machine slower than the delays)
    assert 3 <= run.summary.ok <= 9 and run.summary.requests == run.summary.ok
    assert http_server.max_inflight <= 3
    assert sorted(r.session for r in run.requests) == list(range(run.summary.requests))


async def test_multi_turn_history_and_think_time(http_server: KnownDelayServer) -> None:
    wl = WorkloadConfig(kind="multi-turn", turns="3", input_tokens="20", output_tokens="5",
                        think_time="0.1", prefix_tokens=10)
    result = await run_bench(_config(http_server.base_url, workload=wl, n=6, rate=50.0))
    run = result.runs[0]
    assert run.summary.ok == 6
    by_session: dict[int, list] = {}
    for r in run.requests:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        assert [r.turn for r in turns] == [0, 1, 2]
        # system 10 + per turn 20 user + 5 reply: exact prompt lengths as the server counts them
        assert [r.input_tokens for r in turns] == [30, 55, 80]
        assert [r.prompt_tokens for r in turns] == [30, 55, 80]
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.sent_s - (prev.sent_s + prev.e2e_s) >= 0.095
    assert len(http_server.served[-1].body["messages"]) in (1 + 1, 1 + 3, 1 + 5)


@pytest.mark.parametrize("history", ["actual"])
async def test_multi_turn_actual_history(http_server: KnownDelayServer, history: str) -> None:
    wl = WorkloadConfig(kind="multi-turn", turns="2", input_tokens="8", output_tokens="4", history=history)
    result = await run_bench(_config(http_server.base_url, workload=wl, n=2, rate=50.0))
    assert result.runs[0].summary.ok == 2
    second = [s for s in http_server.served if len(s.body["messages"]) == 3]
    assert second and second[0].body["messages"][1] == {"role": "assistant", "content": "aaaa"}

