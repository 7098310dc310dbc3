"""The capacity planner behind ``meshserve plan`` (DESIGN.md, Sizing).

``ops.plan.model`` holds the arithmetic (pure functions), ``ops.plan.presets`` the model
shapes and GPU data sheets, ``ops.plan.report`` the rendering, ``ops.plan.cli`` the
sub-command.
"""

from ops.plan.model import (
    FleetSize,
    ModelShape,
    Plan,
    PlanInputs,
    concurrent_sequences,
    erlang_c,
    fleet_size,
    kv_bytes_per_token,
    load_model,
    make_plan,
    memory_bound,
    mm1_wait,
    mmc_wait,
    queueing_curve,
    throughput_bound,
)
from ops.plan.presets import GPU_PRESETS, MODEL_PRESETS, GpuSpec, lookup_gpu

__all__ = [
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "FleetSize",
    "GpuSpec",
    "ModelShape",
    "Plan",
    "PlanInputs",
    "concurrent_sequences",
    "erlang_c",
    "fleet_size",
    "kv_bytes_per_token",
    "load_model",
    "lookup_gpu",
    "make_plan",
    "memory_bound",
    "mm1_wait",
    "mmc_wait",
    "queueing_curve",
    "throughput_bound",
]
