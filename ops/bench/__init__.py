"""``meshserve bench``: an open-loop load generator measuring TTFT, TPOT and goodput.

Python API::

    from ops.bench import BenchConfig, EndpointConfig, WorkloadConfig, SLOSpec, run_bench
    result = await run_bench(BenchConfig(
        endpoints=[EndpointConfig("http://127.0.0.1:8000/v1", model="m")],
        workload=WorkloadConfig(input_tokens="512", output_tokens="128"),
        rates=[1, 2, 4], num_requests=200, slo=SLOSpec(ttft_s=1.0, tpot_s=0.05)))
    result.runs[0].summary.ttft_ms.p99, result.knees

Pure parts (arrivals, workload, stats, stream parsing) are importable on their own.
"""

from ops.bench.config import BenchConfig, EndpointConfig, WorkloadConfig
from ops.bench.results import (
    BenchResult,
    ClientHealth,
    Dist,
    RequestResult,
    RunResult,
    SLOSpec,
    Summary,
    load_result,
    save_result,
)
from ops.bench.runner import run_bench, run_bench_blocking

__all__ = [
    "BenchConfig",
    "BenchResult",
    "ClientHealth",
    "Dist",
    "EndpointConfig",
    "RequestResult",
    "RunResult",
    "SLOSpec",
    "Summary",
    "WorkloadConfig",
    "load_result",
    "run_bench",
    "run_bench_blocking",
    "save_result",
]
