"""Prefill and decode apart: the sim replica loading a prefill replica's KV (``SimCore``),
and the router choosing a prefill worker (``Router._split``)."""

from __future__ import annotations

import msgspec
import pytest

from proto import GenerateRequest, SamplingParams, WorkerInfo, pack_tokens, prefill_id
from services.common.fleet import FleetView
from services.router.decision import RouteQuery
from services.router.policy import PolicyConfig
from services.worker.disagg import disaggregable
from services.worker.engines.base import EngineRequest
from services.worker.engines.sim_core import remote_kv
from tests.unit.test_router_policy import add_workers, cache, decided, make_view, q, router, set_load
from tests.unit.test_sim_core import Run, make_core, prompt


def _transfer(tokens: int, cached: int = 0, block_size: int = 16) -> dict[str, object]:
    return {"engine": "sim", "tokens": tokens, "cached_tokens": cached, "block_size": block_size}


def _req(rid: str, tokens: list[int], transfer: dict[str, object] | None = None) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=tokens, sampling=SamplingParams(max_tokens=8, seed=3),
                         kv_transfer=transfer)


# ---- the sim replica ----


def test_loaded_kv_gives_the_same_tokens_and_computes_only_the_tail() -> None:
    tokens = prompt(300)
    here = Run(make_core())
    here.add(_req("r", tokens))
    here.until_idle()
    apart = Run(make_core())
    apart.add(_req("r", tokens, _transfer(len(tokens), cached=32)))
    apart.until_idle()
    assert apart.tokens("r") == here.tokens("r")
    # 288 tokens (18 whole blocks, never the last token) loaded; 12 computed
    assert apart.core.prefill_tokens_total == 300 - 288
    assert here.core.prefill_tokens_total == 300
    # the usage reports the prefill replica's cache hits, as vLLM's remote prefill does
    assert apart.final("r").cached_tokens == 32
    # the loaded blocks are this replica's cache now: a repeat hits them
    again = Run(apart.core)
    again.now = apart.now
    again.add(_req("r2", tokens))
    again.until_idle()
    assert again.final("r2").cached_tokens == 288


def test_the_load_takes_its_bytes_over_the_link_and_the_replica_waits_for_it() -> None:
    tokens = prompt(300)
    core = make_core(kv_transfer_gb_per_s=0.001)  # 1 MB/s: 288 tokens of 1 KiB take ~0.3 s
    run = Run(core)
    run.add(_req("r", tokens, _transfer(300)))
    # Admitted (its blocks held), nothing to compute until the KV has arrived: an idle step to then.
    wait = run.step()
    assert wait is not None and wait.num_scheduled == 0 and not wait.outputs
    assert wait.duration == pytest.approx(0.001 + 288 * 1024 / 1e6)
    assert core.stats(run.now).running == 1 and core.pool.num_used == 18
    run.until_idle()
    final = run.final("r")
    assert final.finish_reason == "length"
    assert final.timings.first_token > 0.29


def test_a_replica_computes_what_it_cannot_load() -> None:
    tokens = prompt(300)
    expected = Run(make_core())
    expected.add(_req("r", tokens))
    expected.until_idle()
    for transfer in (_transfer(300, block_size=32), {"engine": "vllm", "tokens": 300},
                     {"engine": "sim", "tokens": "all", "block_size": 16}, {"engine": "sim", "block_size": 16}):
        run = Run(make_core())
        run.add(_req("r", tokens, transfer))
        run.until_idle()
        assert run.core.prefill_tokens_total == 300, transfer
        assert run.tokens("r") == expected.tokens("r")


def test_remote_kv_loads_whole_blocks_and_never_the_last_token() -> None:
    assert remote_kv(_transfer(64), 64, 16) == (48, 0)  # the last token's block is computed
    assert remote_kv(_transfer(65), 65, 16) == (64, 0)
    assert remote_kv(_transfer(40, cached=100), 100, 16) == (32, 32)  # what it computed, at most
    assert remote_kv(_transfer(10), 10, 16) == (0, 0)
    assert remote_kv(_transfer(-5), 100, 16) == (0, 0)


def test_a_replica_preempted_while_loading_computes_the_prompt_after() -> None:
    # 64 blocks of 16: the loading request (25 blocks) and a more important one (38 blocks,
    # growing) cannot both stay; the loading one goes, and is computed here on its return.
    long = prompt(400, base=1)
    solo = Run(make_core())
    solo.add(_req("long", long))
    solo.until_idle()
    run = Run(make_core(kv_transfer_gb_per_s=0.0001))  # 100 kB/s: the load takes ~4 s
    run.add(_req("long", long, _transfer(400)))
    run.add(EngineRequest(request_id="big", prompt_token_ids=prompt(600, base=2),
                          sampling=SamplingParams(max_tokens=64, seed=1, ignore_eos=True), priority=1))
    run.until_idle()
    assert run.core.preemptions >= 1
    assert run.final("big").finish_reason == "length"
    assert run.tokens("long") == solo.tokens("long")
    assert run.core.prefill_tokens_total >= 600 + 400  # the loaded prompt was computed after all
    assert run.core.pool.num_used == 0


def test_disaggregable_requests() -> None:
    base = GenerateRequest(request_id="r", model="m", prompt=pack_tokens([1, 2, 3]), token_subject="t",
                           prefill_worker="p")
    assert disaggregable(base)
    for change in ({"prefill_worker": ""}, {"prior_output": pack_tokens([4])},
                   {"sampling": SamplingParams(n=2)}, {"sampling": SamplingParams(prompt_logprobs=1)},
                   {"sampling": SamplingParams(max_tokens=0)}):
        assert not disaggregable(msgspec.structs.replace(base, **change)), change  # type: ignore[arg-type]
    q = RouteQuery.from_generate(base)
    assert q.disaggregable
    assert not RouteQuery.from_generate(msgspec.structs.replace(base, sampling=SamplingParams(n=2))).disaggregable


# ---- the router ----


def _split_view(decode: int = 2, prefill: int = 2, *, block_size: int = 16) -> FleetView:
    v = FleetView()
    for i in range(decode):
        v.update_worker(WorkerInfo(worker_id=f"llama-{i}", model="llama", engine="sim", state="ready",
                                   disaggregation=True), 0.0)
    for i in range(prefill):
        v.update_worker(WorkerInfo(worker_id=f"p-{i}", model="llama", engine="sim", state="ready", role="prefill",
                                   disaggregation=True, block_size=block_size), 0.0)
    return v


LONG = list(range(1000, 3000))


def test_a_long_prompt_gets_the_prefill_worker_with_least_ahead() -> None:
    v = _split_view()
    set_load(v, "p-0", queued=4000)
    r = router(v)
    d = decided(r.place(q("r1", LONG, disaggregable=True), 0.0))
    assert d.worker_id.startswith("llama-") and d.prefill_worker == "p-1"
    assert d.prefill_tokens == 1 and d.remote_prefill_tokens == len(LONG)
    # counted on both until their gauges name it: the prompt on the prefill worker
    p1, w = v.worker("p-1"), v.worker(d.worker_id)
    assert p1 is not None and w is not None
    assert p1.opt_prefill_tokens == len(LONG) and w.opt_prefill_tokens == 1
    set_load(v, "p-1", ts=2.0, arrived=[prefill_id("r1")])
    assert p1.opt_prefill_tokens == 0
    # a refusal undoes both
    d2 = decided(r.place(q("r2", LONG, disaggregable=True), 0.0))
    r.release("r2")
    assert all(x.opt_prefill_tokens == 0 for x in v if x.worker_id in (d2.prefill_worker,))


def test_a_prefill_worker_holding_the_prompt_wins() -> None:
    v = _split_view()
    cache(v, "p-0", LONG)
    d = decided(router(v).place(q("r", LONG, disaggregable=True), 0.0))
    assert d.prefill_worker == "p-0" and d.prefill_cached_tokens == len(LONG) // 16 * 16
    assert d.remote_prefill_tokens == len(LONG) - d.prefill_cached_tokens


def test_short_held_or_busy_prompts_stay_where_they_are_placed() -> None:
    v = _split_view()
    r = router(v)
    assert decided(r.place(q("short", list(range(100)), disaggregable=True), 0.0)).prefill_worker == ""
    assert decided(r.place(q("not", LONG), 0.0)).prefill_worker == ""  # n > 1, a migration, ...
    cache(v, "llama-0", LONG)
    cache(v, "llama-1", LONG)
    assert decided(r.place(q("held", LONG, disaggregable=True), 0.0)).prefill_worker == ""
    v2 = _split_view()
    set_load(v2, "p-0", queued=40_000)
    set_load(v2, "p-1", queued=40_000)
    assert decided(router(v2).place(q("busy", LONG, disaggregable=True), 0.0)).prefill_worker == ""


def test_prefill_workers_take_no_request_of_their_own() -> None:
    v = _split_view(decode=1, prefill=3)
    r = router(v, policy="round_robin")
    for i in range(6):
        assert decided(r.place(q(f"r{i}", list(range(64))), 0.0)).worker_id == "llama-0"
    # ... unless nothing else serves the model: each is a whole engine, better than none
    only_prefill = _split_view(decode=0, prefill=1)
    lone = decided(router(only_prefill).place(q("x", LONG, disaggregable=True), 0.0))
    assert lone.worker_id == "p-0" and lone.prefill_worker == ""


def test_a_split_needs_workers_that_can_load_each_others_kv() -> None:
    # a serving worker without the ability (vLLM without a KV connector)
    v = make_view(2)
    v.update_worker(WorkerInfo(worker_id="p-0", model="llama", engine="sim", state="ready", role="prefill",
                               disaggregation=True), 0.0)
    assert decided(router(v).place(q("r", LONG, disaggregable=True), 0.0)).prefill_worker == ""
    # a prefill worker of another block size: its blocks are not the serving worker's
    assert decided(router(_split_view(block_size=32)).place(q("r", LONG, disaggregable=True), 0.0)).prefill_worker == ""


def test_remote_prefill_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        PolicyConfig(remote_prefill_min_tokens=0)
    with pytest.raises(ValueError):
        PolicyConfig(remote_prefill_max_queue_tokens=-1)


def test_a_prefill_worker_back_to_both_takes_requests() -> None:
    v = _split_view(decode=0, prefill=1)
    add_workers(v, 1)
    v.update_worker(WorkerInfo(worker_id="p-0", model="llama", engine="sim", state="ready", role="both"), 1.0)
    seen = {decided(router(v, policy="round_robin").place(q(f"r{i}"), 1.0)).worker_id for i in range(2)}
    assert "p-0" in seen
