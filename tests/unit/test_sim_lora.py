"""Runtime LoRA adapters in the sim (issue 21): GPU slots, a host cache, load times, and
the scheduler setting aside a request whose adapter has no slot (sim_lora, SimCore)."""

from __future__ import annotations

import pytest

from proto.messages import SamplingParams
from services.worker.engines.base import EngineRequest
from services.worker.engines.sim_core import SimCore
from services.worker.engines.sim_lora import LoraConfig, LoraSlots
from services.worker.engines.sim_profile import SimConfig
from tests.unit.test_sim_core import Run, prompt

MB = 1_000_000


def slots(max_loras: int = 2, max_cpu_loras: int = 3, static: tuple[str, ...] = ()) -> LoraSlots:
    return LoraSlots(LoraConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, disk_bytes_per_s=1e9,
                                host_to_gpu_bytes_per_s=1e10), static)


def test_loads_cost_disk_then_host_and_residents_nothing() -> None:
    s = slots()
    assert s.accepts("a", 100 * MB) and s.accepts("b", 200 * MB)
    assert s.activate("a", set()) == pytest.approx(0.1 + 0.01)  # storage, then PCIe
    assert s.activate("a", {"a"}) == 0.0  # resident
    assert s.activate("b", {"a"}) == pytest.approx(0.2 + 0.02)
    assert s.resident() == ["a", "b"] and s.cached() == []
    # a third adapter evicts the least recently used slot not in the batch, to host memory
    assert s.accepts("c", 100 * MB)
    assert s.activate("c", {"b"}) == pytest.approx(0.11)
    assert s.resident() == ["b", "c"] and s.cached() == ["a"]
    # back from host memory: PCIe only
    assert s.activate("a", {"c"}) == pytest.approx(0.01)
    assert (s.loads_from_disk, s.loads_from_host) == (3, 1)


def test_host_cache_keeps_max_cpu_loras_counting_the_slots() -> None:
    s = slots(max_loras=1, max_cpu_loras=2)
    for name in ("a", "b", "c"):
        s.accepts(name, MB)
        s.activate(name, set())
    # vLLM's CPU cache holds the GPU-resident ones too: 2 in all, so "a" fell out
    assert s.resident() == ["c"] and s.cached() == ["b"]
    assert s.activate("a", set()) == pytest.approx(MB / 1e9 + MB / 1e10)  # from storage again


def test_slots_in_use_bound_the_batch_and_static_adapters_are_free() -> None:
    s = slots(max_loras=1, static=("fixed",))
    s.accepts("a", MB)
    s.accepts("b", MB)
    assert s.can_run("a", set()) and s.can_run("fixed", {"a"})
    s.activate("a", set())
    assert not s.can_run("b", {"a"})  # the one slot serves the running batch
    assert s.can_run("b", set())  # once "a" is idle it may be evicted
    with pytest.raises(RuntimeError, match="every slot is in use"):
        s.activate("b", {"a"})
    assert s.activate("fixed", {"a"}) == 0.0


def test_unknown_adapters_need_runtime_loading_and_a_size() -> None:
    static = LoraSlots(LoraConfig(), ("fixed",))
    assert static.accepts("fixed") and not static.accepts("other", MB)
    assert not slots().accepts("no-size")


def core(max_loras: int, max_cpu_loras: int = 4) -> SimCore:
    return SimCore(SimConfig.build("tiny-test", lora=LoraConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                                                                   disk_bytes_per_s=1e9, host_to_gpu_bytes_per_s=1e10)))


def lreq(rid: str, lora: str | None, tokens: int = 40, max_tokens: int = 20, base: int = 0) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=prompt(tokens, base), lora=lora,
                         lora_size_bytes=50 * MB if lora else 0,
                         sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_a_request_whose_adapter_has_no_slot_waits_and_others_pass_it() -> None:
    run = Run(core(max_loras=1))
    run.add(lreq("a1", "a", max_tokens=30))
    first = run.step()
    assert first is not None
    base_step = SimCore(SimConfig.build("tiny-test")).config.profile.costs.step_time(first.prefill_tokens, 0, 40)
    assert first.duration == pytest.approx(base_step + 0.05 + 0.005)  # the load is paid in this step
    run.add(lreq("b1", "b", base=1))  # needs the only slot, which "a" holds
    run.add(lreq("plain", None, base=2))  # the base model passes it
    run.add(lreq("a2", "a", base=3))  # so does a request for the resident adapter
    run.until_idle()
    started = {rid: run.final(rid).timings.first_token for rid in ("a1", "b1", "plain", "a2")}
    finished = {rid: run.final(rid).timings.finished for rid in ("a1", "a2")}
    assert started["plain"] < finished["a1"] and started["a2"] < finished["a1"]
    assert started["b1"] > max(finished.values())  # its slot freed only once "a" was idle
    assert run.core.lora.resident() == ["b"] and run.core.lora.cached() == ["a"]
    assert all(run.final(r).finish_reason == "length" for r in started)


def test_the_gauge_reports_resident_and_cached_adapters_and_unknown_ones_are_refused() -> None:
    run = Run(core(max_loras=2))
    for i, name in enumerate(("x", "y", "z")):
        run.add(lreq(f"r{i}", name, base=i))
        run.until_idle()
    stats = run.core.stats(run.now)
    assert stats.lora_adapters == ["y", "z"] and stats.lora_cached == ["x"]
    static = Run(SimCore(SimConfig.build("tiny-test", lora_adapters=("fixed",))))
    out = static.add(lreq("bad", "other"))
    assert out is not None and out.error == "unknown LoRA adapter 'other'"
    assert static.add(lreq("ok", "fixed")) is None
