"""Worker metrics under vLLM's Prometheus names, so vLLM dashboards and KEDA triggers work.

Names and units follow vLLM v1 (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
as a 0–1 fraction, token counters, latency histograms with vLLM's bucket edges), labelled
with ``model_name`` and ``engine`` like vLLM. One deviation: ``vllm:inter_token_latency_seconds``
is observed once per request (its mean gap), not once per token, to keep the hot path cheap.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proto import Timings
from services.common.latency_buckets import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS

from .engines.base import EngineStats


class WorkerMetrics:
    def __init__(self, model: str, engine: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name", "engine"]
        self._labels = {"model_name": model, "engine": engine}
        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative preemptions", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", labels, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency (per-request mean)", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time in WAITING", labels, buckets=REQUEST_BUCKETS, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Time in prefill", labels, buckets=REQUEST_BUCKETS, registry=r)
        self.decode = Histogram("vllm:request_decode_time_seconds", "Time in decode", labels, buckets=REQUEST_BUCKETS, registry=r)
        for reason in ("stop", "length", "abort", "error"):  # as vLLM: every reason's series from the start
            self.success.labels(**self._labels, finished_reason=reason)
        self._preemptions_seen = 0

    def cache_config(self, block_size: int, num_blocks: int, prefix_caching: bool = True) -> None:
        """vLLM's ``vllm:cache_config_info``: the KV cache's shape as labels of a gauge at 1
        (what ``meshserve calibrate --engine-url`` and vLLM dashboards read)."""
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ["engine", "block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=self.registry)
        info.labels(engine=self._labels["engine"], block_size=str(block_size), num_gpu_blocks=str(num_blocks),
                    enable_prefix_caching=str(prefix_caching)).set(1)

    def observe_stats(self, stats: EngineStats) -> None:
        self.running.labels(**self._labels).set(stats.running)
        self.waiting.labels(**self._labels).set(stats.waiting)
        self.kv_usage.labels(**self._labels).set(stats.kv_usage)
        if stats.preemptions > self._preemptions_seen:
            self.preemptions.labels(**self._labels).inc(stats.preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.preemptions

    def observe_request(self, finish_reason: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                        timings: Timings | None) -> None:
        lab = self._labels
        self.success.labels(**lab, finished_reason=finish_reason).inc()
        self.prompt_tokens.labels(**lab).inc(prompt_tokens)
        self.generation_tokens.labels(**lab).inc(completion_tokens)
        self.prefix_queries.labels(**lab).inc(prompt_tokens)
        self.prefix_hits.labels(**lab).inc(cached_tokens)
        if timings is None or not timings.arrival or not timings.finished:
            return
        self.e2e.labels(**lab).observe(timings.finished - timings.arrival)
        if timings.scheduled:
            self.queue.labels(**lab).observe(timings.scheduled - timings.arrival)
        if timings.first_token:
            self.ttft.labels(**lab).observe(timings.first_token - timings.arrival)
            if timings.scheduled:
                self.prefill.labels(**lab).observe(timings.first_token - timings.scheduled)
            self.decode.labels(**lab).observe(timings.finished - timings.first_token)
            if completion_tokens > 1:
                self.itl.labels(**lab).observe((timings.finished - timings.first_token) / (completion_tokens - 1))
