"""The Nomad job specs, parsed with python-hcl2 and checked against the real CLI.

Every task that runs meshserve: its command line parses with ``meshserve``'s own parser
(Nomad's runtime variables filled with sample values), the ports its flags open are its
group's ports and health checks, its environment (env blocks and env templates) names only
variables meshserve reads, it connects as its own NATS user to the servers Nomad's service
discovery knows. The worker job is the one the autoscaler's Nomad driver, built from the
control job's own arguments, scales; it asks for a GPU, drains within its kill_timeout and
has a scaling block. The NATS job is a 3-node JetStream cluster with meshserve's accounts.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import hcl2
import pytest
from hcl2.utils import SerializationOptions

from ops.nats import accounts
from services.autoscaler.main import build as build_autoscaler
from tests.deploy.deployspec import (
    COMPOSE_DIR,
    ROOT,
    duration_s,
    env_name_is_read,
    listening_ports,
    parse_serve,
)

NOMAD_DIR = COMPOSE_DIR / "nomad"
EXTRA_ENV = {"worker": {"HF_TOKEN"}}  # read by vLLM / huggingface_hub
# Sample values of Nomad's runtime interpolation (attributes, allocation ids).
RUNTIME = {
    "NOMAD_ALLOC_ID": "5a1d3b0e-8c7f-4a2b-9d6e-0f1e2d3c4b5a",
    "NOMAD_SHORT_ALLOC_ID": "5a1d3b0e",
    "NOMAD_ALLOC_INDEX": "0",
    "attr.unique.network.ip-address": "10.0.0.7",
}
OPTIONS = SerializationOptions(with_comments=False, explicit_blocks=False, preserve_heredocs=False, strip_string_quotes=True)


def load(name: str) -> dict[str, Any]:
    with (NOMAD_DIR / name).open() as f:
        return dict(hcl2.load(f, serialization_options=OPTIONS))


def blocks(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Labelled blocks (``group "x" { }``) as one mapping by label."""
    out: dict[str, Any] = {}
    for item in items or []:
        out.update(item)
    return out


class Job:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.spec = load(filename)
        self.variables = {name: v.get("default") for name, v in blocks(self.spec.get("variable")).items()}
        (self.id, self.job), = blocks(self.spec["job"]).items()

    def resolve(self, value: Any) -> Any:
        """HCL variables (``${var.x}``) from their defaults; Nomad's runtime ones from samples."""
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if not isinstance(value, str):
            return value

        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            if name.startswith("var."):
                return str(self.variables[name[4:]])
            assert name in RUNTIME, f"{self.filename}: unknown interpolation ${{{name}}}"
            return RUNTIME[name]

        return re.sub(r"\$\{([A-Za-z0-9_.-]+)\}", sub, value)

    def groups(self) -> dict[str, dict[str, Any]]:
        return blocks(self.job.get("group"))

    def tasks(self) -> list[tuple[str, dict[str, Any], str, dict[str, Any]]]:
        return [(g, group, t, task) for g, group in self.groups().items() for t, task in blocks(group.get("task")).items()]


JOBS = {name: Job(f"{name}.nomad.hcl") for name in ("nats", "control", "worker")}


def template_data(task: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    return [(t, str(t.get("data", "")).replace('\\"', '"')) for t in task.get("template", [])]


# NAME=value, maybe opened by {{ with ... }} and closed by {{ end }} on the same line.
_ENV_LINE = re.compile(r"^\s*(?:\{\{-?\s*with [^}]*\}\})?\s*([A-Z_][A-Z0-9_]*)=(.*?)(?:\{\{-?\s*end\s*-?\}\})?\s*$")


def task_env(task: dict[str, Any]) -> dict[str, str]:
    """env blocks plus the NAME= lines of templates rendered into the environment."""
    env = {k: str(v) for block in task.get("env", []) for k, v in block.items()}
    for template, data in template_data(task):
        if template.get("env"):
            for line in data.splitlines():
                m = _ENV_LINE.match(line)
                if m:
                    env[m.group(1)] = m.group(2)
    return env


def meshserve_tasks(job: Job) -> list[tuple[str, dict[str, Any], str, dict[str, Any], str, argparse.Namespace]]:
    out = []
    for g, group, t, task in job.tasks():
        config = task["config"][0]
        if config.get("command") == "meshserve":
            service, args = parse_serve(["meshserve", *job.resolve(config.get("args", []))])
            out.append((g, group, t, task, service, args))
    return out


def group_ports(group: dict[str, Any]) -> dict[str, int]:
    """Port label → the container port it maps to (``to``, else its static port)."""
    out = {}
    for network in group.get("network", []):
        for label, port in blocks(network.get("port")).items():
            out[label] = int(port.get("to") or port.get("static"))
    return out


# ------------------------------------------------------------------------------ the tests


def test_every_meshserve_task_parses_with_the_real_cli() -> None:
    found = set()
    for name in ("control", "worker"):
        for _, _, task_name, task, service, _ in meshserve_tasks(JOBS[name]):
            assert task_name == service, f"{name}: task {task_name} runs {service}"
            assert task["driver"] == "docker"
            found.add(service)
    assert found == set(accounts.SERVICES)


@pytest.mark.parametrize("name", ["control", "worker"])
def test_environment_and_nats_connection(name: str) -> None:
    job = JOBS[name]
    nats_services = {s["name"] for _, group in JOBS["nats"].groups().items() for s in group.get("service", [])}
    for _, _, _, task, service, _ in meshserve_tasks(job):
        env = task_env(task)
        for key in env:
            assert env_name_is_read(key) or key in EXTRA_ENV.get(service, set()), f"{service}: {key} is read by nothing"
        assert env["MESHSERVE_JS_REPLICAS"] == "3"
        assert env["OTEL_SERVICE_NAME"] == f"meshserve-{service}"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4318"), "bus.tracing exports OTLP/HTTP"
        assert env["MESHSERVE_NATS_USER"] == service
        url = env["MESHSERVE_NATS_URL"]
        m = re.search(r'nomadService "([^"]+)"', url)
        assert m and m.group(1) in nats_services, f"{service}: NATS servers from {url}"
        assert "nats://{{ .Address }}:{{ .Port }}" in url
        # The password comes from the job's Nomad variable, under the user's name.
        data = "\n".join(d for t, d in template_data(task) if t.get("env"))
        assert re.search(rf'nomadVar "nomad/jobs/{re.escape(job.id)}".*MESHSERVE_NATS_PASSWORD=\{{\{{ \.{service} \}}\}}', data, re.S)


@pytest.mark.parametrize("name", ["control", "worker"])
def test_ports_and_health_checks(name: str) -> None:
    for group_name, group, task_name, task, service, args in meshserve_tasks(JOBS[name]):
        listens = listening_ports(service, args)
        ports = group_ports(group)
        assert set(ports.values()) <= set(listens), f"{group_name}: ports {ports} but it listens on {sorted(listens)}"
        assert set(task["config"][0].get("ports", [])) == set(ports), f"{task_name}: maps {task['config'][0].get('ports')}"
        for port in ports.values():
            assert listens[port] == "0.0.0.0", f"{task_name}: port {port} bound to {listens[port]}"
        services = group.get("service", [])
        assert services, f"{group_name}: no service registration"
        checks = [c for s in services for c in s.get("check", [])]
        assert checks, f"{group_name}: no health check"
        for check in checks:
            if check["type"] == "http":
                port = ports[check["port"]]
                expected = "/healthz" if service == "gateway" and port == args.port else "/metrics"
                assert check["path"] == expected, f"{group_name}: checks {check['path']} on {port}"
                assert all(s.get("provider") == "nomad" for s in services)
            else:
                # Nomad's own service discovery runs http and tcp checks only.
                assert check["type"] == "script" and check["command"] == "meshserve-healthcheck"
                assert check["task"] == task_name
                assert all(s.get("provider") == "consul" for s in services)
        assert task["kill_signal"] == "SIGTERM"
        # The autoscaler's --drain-timeout is what the workers it drains get, not its own.
        drain = getattr(args, "drain_timeout", None) if service != "autoscaler" else None
        if drain is not None:
            assert duration_s(task["kill_timeout"]) > drain, f"{task_name}: killed before its drain ends"
        if service == "gateway":
            assert ports, "the gateway's port is mapped"


def test_the_autoscaler_scales_the_worker_job() -> None:
    control, worker = JOBS["control"], JOBS["worker"]
    (_, _, _, scaler_task, _, scaler_args), = [t for t in meshserve_tasks(control) if t[4] == "autoscaler"]
    (_, group, _, worker_task, _, worker_args), = meshserve_tasks(worker)
    assert scaler_args.driver == "nomad"
    config, driver = build_autoscaler(scaler_args)
    pools = [p.pool for p in config.pools]
    assert pools == [worker_args.model], "the autoscaler scales the pool the workers serve"
    assert driver.job_id(worker_args.model) == worker.id, "the Nomad driver looks for this job id"
    assert driver.group in worker.groups(), f"no task group {driver.group!r} in {worker.id}"
    assert driver.address == "http://10.0.0.7:4646"
    # The driver's default template finds the same job too.
    from services.autoscaler.drivers import NomadDriver, pool_slug

    assert NomadDriver().job_template.format(pool=pool_slug(worker_args.model)) == worker.id
    # Allocations are found by worker id (--worker-id ${NOMAD_ALLOC_ID}).
    assert worker_args.worker_id == RUNTIME["NOMAD_ALLOC_ID"]
    assert duration_s(worker_task["kill_timeout"]) > config.drain_timeout_s
    scaling = group["scaling"][0]
    assert scaling["enabled"] is True
    assert scaling["min"] <= group["count"] <= scaling["max"]
    assert scaling["max"] >= max(p.max_replicas for p in config.pools), "the driver caps at the job's scaling max"
    assert "identity" in scaler_task and scaler_task["identity"][0]["env"] is True, "NOMAD_TOKEN from workload identity"
    policy = (NOMAD_DIR / "autoscaler-policy.hcl").read_text()
    for capability in ("read-job", "scale-job", "alloc-lifecycle"):
        assert f'"{capability}"' in policy


def test_worker_asks_for_a_gpu_and_drains() -> None:
    (_, _, _, task, service, args) = meshserve_tasks(JOBS["worker"])[0]
    assert service == "worker" and args.engine == "vllm"
    devices = blocks(task["resources"][0].get("device"))
    assert devices == {"nvidia/gpu": {"count": 1}}
    assert task["kill_signal"] == "SIGTERM"
    assert duration_s(task["kill_timeout"]) >= args.drain_timeout


def test_nats_job_is_a_three_node_jetstream_cluster() -> None:
    job = JOBS["nats"]
    (_, group), = job.groups().items()
    assert group["count"] == 3
    assert {"operator": "distinct_hosts", "value": "true"} in group["constraint"]
    assert group["update"][0]["max_parallel"] == 1, "one node at a time keeps the R3 quorum"
    (_, task), = blocks(group["task"]).items()
    templates = {t["destination"]: (t, d) for t, d in template_data(task)}
    conf = templates["local/nats.conf"][1]
    assert "include ./accounts.conf" in conf and "jetstream {" in conf
    assert 'nomadService "meshserve-nats-cluster"' in conf
    assert task["config"][0]["args"] == ["-c", "/local/nats.conf"]
    services = {s["name"]: s for s in group["service"]}
    assert {"meshserve-nats", "meshserve-nats-cluster"} <= set(services)
    ports = {label: int(p["static"]) for n in group["network"] for label, p in blocks(n["port"]).items()}
    assert ports[services["meshserve-nats"]["port"]] == 4222
    assert ports[services["meshserve-nats-cluster"]["port"]] == 6222
    assert "js-enabled-only" in services["meshserve-nats"]["check"][0]["path"]
    # The accounts file is the generated one; every user's password reaches the server.
    accounts_data = templates["local/accounts.conf"][0]["data"]
    m = re.fullmatch(r'\$\{file\("([^"]+)"\)\}', accounts_data)
    assert m and (ROOT / m.group(1)).resolve() == (ROOT / "ops" / "nats" / "accounts.conf").resolve()
    passwords = task_env(task)
    users = [*accounts.SERVICES, accounts.OPS_USER, accounts.SYSTEM_USER, *accounts.DEFAULT_API_CLIENTS]
    assert {accounts.password_env(u) for u in users} <= set(passwords), "a NATS user without a password"
    for user in users:
        assert passwords[accounts.password_env(user)] == f"{{{{ .{user} }}}}"
    assert task["kill_signal"] == "SIGUSR2", "lame-duck mode before stopping"
    # Routes authenticate (port 6222 reaches across hosts), and dial with the same password.
    cluster = conf[conf.index("cluster {"):conf.index("include ./accounts.conf")]
    assert re.search(r'authorization \{\s*user: "route"\s*password: \$NATS_CLUSTER_PASSWORD\s*\}', cluster)
    assert passwords["NATS_CLUSTER_PASSWORD"] == "{{ .cluster }}"
    assert '"nats-route://route:{{ with nomadVar "nomad/jobs/meshserve-nats" }}{{ .cluster }}{{ end }}@' in cluster


def test_job_files_are_where_the_docs_say(tmp_path: Path) -> None:
    for name in ("nats", "control", "worker"):
        text = (NOMAD_DIR / f"{name}.nomad.hcl").read_text()
        assert f"nomad job run compose/nomad/{name}.nomad.hcl" in text
