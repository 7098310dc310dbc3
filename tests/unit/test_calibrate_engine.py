"""The parsing half of ``meshserve calibrate --engine-url``: vLLM's Prometheus text."""

from __future__ import annotations

from ops.calibrate_engine import PREFILL_COUNT, PREFILL_SUM, cache_config, metric_sums

VLLM_METRICS = """\
# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 3.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 0.012
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 3.0
vllm:request_prefill_time_seconds_sum{engine="1",model_name="tiny"} 0.5
vllm:request_prefill_time_seconds_count{engine="1",model_name="tiny"} 1.0
vllm:request_prefill_time_seconds_created{engine="0",model_name="tiny"} 1.7e+09
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="64",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_sums_add_every_engine_and_skip_buckets() -> None:
    sums = metric_sums(VLLM_METRICS, [PREFILL_SUM, PREFILL_COUNT, "vllm:absent"])
    assert sums == {PREFILL_SUM: 0.512, PREFILL_COUNT: 4.0, "vllm:absent": 0.0}


def test_cache_config_reads_block_size_and_blocks() -> None:
    assert cache_config(VLLM_METRICS) == (128, 64)
    assert cache_config("vllm:num_requests_running 0.0\n") is None
    assert cache_config('vllm:cache_config_info{block_size="16"} 1.0\n') is None
