"""The workers' vllm: metrics and the gateway's meshserve: ones read as vLLM's do."""

from __future__ import annotations

from prometheus_client import generate_latest

from services.gateway.metrics import GatewayMetrics
from services.worker.metrics import WorkerMetrics


def test_histograms_reach_vllms_top_edges_and_every_finish_reason_starts_at_zero() -> None:
    """vLLM's TTFT edges go on to 2,560 s and its request ones to 7,680 s: ours stopped at
    80 and 960, where a saturated queue's quantiles then flattened. vLLM creates each
    finish reason's series at 0; ours appeared with the first such request."""
    worker = WorkerMetrics("m", "vllm")
    worker.ttft.labels(model_name="m", engine="vllm")
    worker.e2e.labels(model_name="m", engine="vllm")
    text = generate_latest(worker.registry).decode()
    assert 'vllm:time_to_first_token_seconds_bucket{engine="vllm",le="2560.0",model_name="m"}' in text
    assert 'vllm:e2e_request_latency_seconds_bucket{engine="vllm",le="7680.0",model_name="m"}' in text
    for reason in ("stop", "length", "abort", "error"):
        assert f'vllm:request_success_total{{engine="vllm",finished_reason="{reason}",model_name="m"}} 0.0' in text
    gateway = GatewayMetrics()
    gateway.ttft.labels(model="m")
    assert 'meshserve:time_to_first_token_seconds_bucket{le="2560.0",model="m"}' in generate_latest(
        gateway.registry).decode()
