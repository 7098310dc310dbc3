"""The KEDA example scales on metrics the workers really export."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from services.worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]


def test_scaledobject_queries_exported_worker_metrics() -> None:
    doc = yaml.safe_load((ROOT / "compose/keda/scaledobject.yaml").read_text())
    assert doc["kind"] == "ScaledObject" and doc["apiVersion"].startswith("keda.sh/")
    exported = {m.name for m in WorkerMetrics("m", "vllm").registry.collect()}
    queries = [t["metadata"]["query"] for t in doc["spec"]["triggers"]]
    assert queries
    for query in queries:
        for name in re.findall(r"vllm:[a-z_]+", query):
            assert name in exported, f"{name} is not exported by workers"
    assert doc["spec"]["minReplicaCount"] <= doc["spec"]["maxReplicaCount"]
