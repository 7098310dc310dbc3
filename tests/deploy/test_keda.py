"""The KEDA example scales on metrics the workers really export."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from services.worker.metrics import WorkerMetrics
from tests.deploy.deployspec import exported_labels, selectors

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


def test_scaledobject_selects_the_workers_series_and_scales_on_an_average_by_value() -> None:
    """It filtered on a model name no worker serves (workers label the name they serve:
    the compose default), so KEDA read nothing; and an average as AverageValue gives
    ceil(average / threshold) replicas, never above 2 for a utilisation."""
    doc = yaml.safe_load((ROOT / "compose/keda/scaledobject.yaml").read_text())
    compose = (ROOT / "compose/docker-compose.yml").read_text()
    default_model = re.search(r"\$\{MODEL:-([^}]+)\}", compose)
    assert default_model is not None
    labels = exported_labels(WorkerMetrics(default_model[1], "vllm").registry)
    for trigger in doc["spec"]["triggers"]:
        query = trigger["metadata"]["query"]
        for name, matchers in selectors(query):
            assert set(matchers) <= labels[name], (name, matchers)
            assert matchers.get("model_name") == default_model[1], query
        if query.startswith("avg("):
            assert trigger.get("metricType") == "Value", trigger
