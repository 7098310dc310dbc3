"""Admission on a light load, on a real nats-server with real services (issue 14).

The default mesh (sim workers in real time, the development key's premium tier) used to
refuse requests on an idle mesh from the second benchmark run on: the workers' prefill
rate collapsed to ~300 tokens/s once prompts were cached (a step carrying one cached
prompt is mostly fixed per-step cost), and the calibration factor learnt the gateway's
and the bus's own latency, which dwarfs a 40 ms prediction, as a 2-4× multiplier.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import openai
import pytest

from bus import Bus, BusSettings
from ops.keys import create_key
from services.admission.service import AdmissionService
from services.gateway.service import GatewayConfig, GatewayService
from services.router.service import RouterService
from services.worker.engines.sim import SimEngine
from services.worker.service import WorkerConfig, WorkerService
from tests.conftest import eventually

MODEL = "sim-llama-8b"



@pytest.fixture
async def light_mesh(bus_settings: BusSettings) -> AsyncIterator[tuple[list[WorkerService], AdmissionService,
                                                                        GatewayService]]:
    """Two real-time sim workers (the default profile), router, admission, gateway."""
    started: list[WorkerService | AdmissionService | GatewayService | RouterService] = []
    try:
        workers = []
        for i in range(2):
            engine = SimEngine(model=MODEL, speed=1.0, max_model_len=8192, num_kv_blocks=4096)
            w = WorkerService(engine, WorkerConfig(worker_id=f"w{i}", gauge_interval_s=0.25, drain_timeout_s=10),
                              bus_settings)
            await w.start()
            started.append(w)
            workers.append(w)
        router = RouterService(settings=bus_settings)
        await router.start()
        started.append(router)
        admission = AdmissionService(settings=bus_settings)
        await admission.start()
        started.append(admission)
        gateway = GatewayService(GatewayConfig(port=0), bus_settings)
        await gateway.start()
        started.append(gateway)
        yield workers, admission, gateway
    finally:
        for service in reversed(started):
            with contextlib.suppress(Exception):
                await service.drain_and_close()


async def test_repeated_light_runs_are_never_refused_and_predicted_within_2x(
    bus: Bus, light_mesh: tuple[list[WorkerService], AdmissionService, GatewayService]
) -> None:
    workers, admission, gateway = light_mesh
    key, record = await create_key(bus, org="dev", tier="premium")
    await eventually(lambda: record.key_id in gateway.keys.records, what="the gateway to see the key")
    await eventually(lambda: len(admission.book) == 2, what="admission to see both workers")
    # Five "benchmark runs" of the same 12 prompts (~560 tokens, as `meshserve bench`
    # sends): from the second run on every prompt is cached on some worker.
    prompts = [f"run-invariant prompt {i}: " + "lorem ipsum dolor sit amet " * 20 for i in range(12)]
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.bound_port}/v1", api_key=key,
                                  max_retries=0) as client:
        for _ in range(5):
            for prompt in prompts:
                done = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
                assert done.choices[0].text
                await asyncio.sleep(0.05)  # a light load: one request at a time
    assert admission.rejected == {}
    await eventually(lambda: sum(int(e["n"]) for e in admission.policy.prediction_errors().values()) >= 55,
                     what="the TTFT reports")
    # The workers' prefill rate is their capacity, whatever the last steps carried.
    for w in workers:
        gauge = w.engine.stats()
        assert gauge.prefill_tokens_per_s > 10_000, gauge
    # (That light-load outcomes leave the calibration factor at 1 is the unit tests' to
    # check: here one request stalled 250 ms by a busy machine rightly moves the tail factor.)
    errors = admission.policy.prediction_errors()["premium"]
    assert 0.5 <= errors["p50"] <= 2.0, errors
