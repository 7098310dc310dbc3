"""The compose deployment, checked without a Docker engine.

Each compose file, and the base file merged with the CPU override the way Compose merges
them, validates against the Compose Specification schema (vendored in compose/schema). Then
every service that runs meshserve is checked against the real CLI: its command parses with
``meshserve``'s own parser, its ports are the ones its flags open, its environment names
only variables meshserve reads, its NATS user exists with the password the NATS nodes
expect; dependencies, mounted files, the Prometheus targets, the dashboard's metrics, the
collector and the Dockerfile are checked against what they point at.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from ops.nats import accounts
from services.gateway.metrics import GatewayMetrics
from services.worker.metrics import WorkerMetrics
from tests.deploy.deployspec import (
    COMPOSE_DIR,
    ROOT,
    VLLM_METRICS,
    duration_s,
    env_name_is_read,
    exported_labels,
    listening_ports,
    parse_cli,
    parse_serve,
    selectors,
)

BASE = COMPOSE_DIR / "docker-compose.yml"
CPU = COMPOSE_DIR / "docker-compose.cpu.yml"
SCHEMA = COMPOSE_DIR / "schema" / "compose-spec.json"
# Variables a service reads besides meshserve's: the vLLM worker's Hugging Face token.
EXTRA_ENV = {"worker": {"HF_TOKEN"}}
NATS_NODES = ("nats-1", "nats-2", "nats-3")


# ------------------------------------------------------------------ loading like Compose does


class Reset:
    """Compose's ``!reset`` tag: the merged value becomes this one, not a merge."""

    def __init__(self, value: Any) -> None:
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


def _reset(loader: yaml.SafeLoader, node: yaml.Node) -> Reset:
    if isinstance(node, yaml.SequenceNode):
        return Reset(loader.construct_sequence(node, deep=True))
    if isinstance(node, yaml.MappingNode):
        return Reset(loader.construct_mapping(node, deep=True))
    return Reset(loader.construct_scalar(node) or None)  # type: ignore[arg-type]


ComposeLoader.add_constructor("!reset", _reset)
ComposeLoader.add_constructor("!override", _reset)

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, Reset):
        return Reset(interpolate(value.value, env))
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4) or ""
        current = env.get(name)
        if op == ":-":
            return current if current else interpolate(arg, env)
        if op == "-":
            return current if current is not None else interpolate(arg, env)
        if op in (":?", "?"):
            if not current:
                raise AssertionError(f"required variable {name} is unset: {arg}")
            return current
        if op in (":+", "+"):
            return interpolate(arg, env) if current else ""
        return current or ""

    return _VAR.sub(sub, value)


def load(path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    with path.open() as f:
        data = yaml.load(f, Loader=ComposeLoader)
    return dict(interpolate(data, env or {}))


def resolve_resets(value: Any) -> Any:
    if isinstance(value, Reset):
        return resolve_resets(value.value)
    if isinstance(value, dict):
        return {k: resolve_resets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_resets(v) for v in value]
    return value


_REPLACED = {"command", "entrypoint"}


def merge(base: Any, override: Any, path: tuple[str, ...] = ()) -> Any:
    """Compose's merge of an override file: mappings merge, most sequences append, commands replace."""
    if isinstance(override, Reset):
        return copy.deepcopy(resolve_resets(override.value))
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base.get(key), value, (*path, key)) if key in base else resolve_resets(value)
        return out
    if isinstance(base, list) and isinstance(override, list):
        if (path and path[-1] in _REPLACED) or path[-2:] == ("healthcheck", "test"):
            return resolve_resets(override)
        out_list = list(base)
        for item in resolve_resets(override):
            if item not in out_list:
                out_list.append(item)
        return out_list
    return resolve_resets(override)


def models(env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    base = load(BASE, env)
    return {"base": resolve_resets(base), "cpu": merge(base, load(CPU, env))}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return dict(json.loads(SCHEMA.read_text()))


def validate(instance: Any, schema: dict[str, Any]) -> None:
    # The schema says draft 2019-09 (by a URI jsonschema does not know): name the draft.
    jsonschema.Draft201909Validator(schema).validate(instance)


MODELS = models()


def services(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(model["services"])


def meshserve_services(model: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """Compose service name → (meshserve service, parsed args), for `meshserve serve` containers."""
    out = {}
    for name, svc in services(model).items():
        command = svc.get("command")
        if isinstance(command, list) and command[:2] == ["meshserve", "serve"]:
            out[name] = parse_serve(command)
    return out


def env_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def container_ports(svc: dict[str, Any]) -> dict[int, int | None]:
    """Container port → published host port (None: only exposed)."""
    out: dict[int, int | None] = {}
    for spec in svc.get("ports") or []:
        if isinstance(spec, dict):
            out[int(spec["target"])] = int(spec["published"]) if spec.get("published") else None
            continue
        parts = str(spec).split("/")[0].split(":")
        out[int(parts[-1])] = int(parts[-2]) if len(parts) >= 2 else None
    for spec in svc.get("expose") or []:
        out.setdefault(int(str(spec).split("/")[0]), None)
    return out


def depends_on(svc: dict[str, Any]) -> list[str]:
    deps = svc.get("depends_on") or []
    return list(deps) if isinstance(deps, (list, dict)) else []


# ------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("path", [BASE, CPU], ids=lambda p: p.name)
def test_each_file_validates_against_the_compose_spec(path: Path, schema: dict[str, Any]) -> None:
    validate(resolve_resets(load(path)), schema)


@pytest.mark.parametrize("which", ["base", "cpu"])
def test_merged_model_validates_against_the_compose_spec(which: str, schema: dict[str, Any]) -> None:
    validate(MODELS[which], schema)
    # With deployment values too (what an operator puts in compose/.env).
    values = {"MODEL": "Qwen/Qwen2.5-7B-Instruct", "TAG": "1.2.3", "POSTGRES_PASSWORD": "s3cret", "DOCKER_GID": "998"}
    validate(models(values)[which], schema)


def test_a_schema_violation_is_caught(schema: dict[str, Any]) -> None:
    broken = copy.deepcopy(MODELS["base"])
    broken["services"]["gateway-1"]["restart_policy"] = "always"
    with pytest.raises(jsonschema.ValidationError):
        validate(broken, schema)


@pytest.mark.parametrize("which", ["base", "cpu"])
def test_every_meshserve_command_parses_with_the_real_cli(which: str) -> None:
    model = MODELS[which]
    for name, svc in services(model).items():
        command = svc.get("command")
        image = str(svc.get("image", ""))
        if image.startswith("meshserve"):
            assert isinstance(command, list) and command[0] == "meshserve", f"{name}: {command}"
            assert "entrypoint" not in svc, f"{name}: the command is the whole command line"
            parse_cli(command[1:])
    found = {service for service, _ in meshserve_services(model).values()}
    assert found == set(accounts.SERVICES), f"services without a container: {set(accounts.SERVICES) - found}"


@pytest.mark.parametrize("which", ["base", "cpu"])
def test_environment_names_only_what_meshserve_reads(which: str) -> None:
    model = MODELS[which]
    node_env = env_of(services(model)["nats-1"])
    for name, (service, _) in meshserve_services(model).items():
        env = env_of(services(model)[name])
        for key in env:
            assert env_name_is_read(key) or key in EXTRA_ENV.get(service, set()), f"{name}: {key} is read by nothing"
        nodes = env["MESHSERVE_NATS_URL"].split(",")
        assert [n.removeprefix("nats://").split(":")[0] for n in nodes] == list(NATS_NODES), f"{name}: {nodes}"
        assert all(n.endswith(":4222") for n in nodes)
        assert env["MESHSERVE_JS_REPLICAS"] == "3"
        assert env["OTEL_SERVICE_NAME"] == f"meshserve-{service}"
        endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        host, port = endpoint.removeprefix("http://").split(":")
        assert host in services(model) and int(port) in container_ports(services(model)[host]), endpoint
        assert int(port) == 4318, "bus.tracing exports OTLP/HTTP"
        # Its own NATS user, with the password every NATS node was given for that user.
        assert env["MESHSERVE_NATS_USER"] == service, f"{name}: connects as {env['MESHSERVE_NATS_USER']}"
        assert env["MESHSERVE_NATS_PASSWORD"] == node_env[accounts.password_env(service)], name


@pytest.mark.parametrize("which", ["base", "cpu"])
def test_ports_are_the_ones_the_flags_open(which: str) -> None:
    model = MODELS[which]
    published: dict[int, str] = {}
    for name, (service, args) in meshserve_services(model).items():
        listens = listening_ports(service, args)
        declared = container_ports(services(model)[name])
        assert set(declared) <= set(listens), f"{name}: ports {sorted(declared)} but it listens on {sorted(listens)}"
        for port in declared:
            assert listens[port] == "0.0.0.0", f"{name}: port {port} is bound to {listens[port]}, unreachable from outside"
        if service == "gateway":
            assert declared.get(args.port), f"{name}: the gateway's port is not published"
        for host_port in declared.values():
            if host_port is not None:
                assert host_port not in published, f"{name}: host port {host_port} also used by {published[host_port]}"
                published[host_port] = name
    gateway_ids = [args.gateway_id for _, (s, args) in meshserve_services(model).items() if s == "gateway"]
    assert len(gateway_ids) == 2 and len(set(gateway_ids)) == 2 and all(gateway_ids)


@pytest.mark.parametrize("which", ["base", "cpu"])
def test_dependencies_exist(which: str) -> None:
    model = MODELS[which]
    names = set(services(model))
    for name, svc in services(model).items():
        for dep in depends_on(svc):
            assert dep in names, f"{name} depends on {dep}, which is no service"
            assert not services(model)[dep].get("profiles"), f"{name} depends on {dep}, which only runs with a profile"
        if name in meshserve_services(model):
            assert set(NATS_NODES) <= set(depends_on(svc)), f"{name} does not wait for NATS"


@pytest.mark.parametrize("which", ["base", "cpu"])
def test_mounted_files_exist(which: str) -> None:
    for name, svc in services(MODELS[which]).items():
        for volume in svc.get("volumes") or []:
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source} does not exist"
        build = svc.get("build")
        if isinstance(build, dict):
            context = COMPOSE_DIR / build["context"]
            assert (context / build["dockerfile"]).is_file(), f"{name}: no {build['dockerfile']} in {context}"
            assert build["args"]["VARIANT"] in ("control", "worker")


def test_nats_cluster_nodes() -> None:
    model = MODELS["base"]
    cluster_conf = (ROOT / "ops" / "nats" / "cluster.conf").read_text()
    for node in NATS_NODES:
        svc = services(model)[node]
        assert svc["command"] == ["-c", "/etc/nats/cluster.conf"]
        assert "../ops/nats:/etc/nats:ro" in svc["volumes"]
        assert any(str(v).endswith(":/data") for v in svc["volumes"]), "JetStream store on a volume"
        env = env_of(svc)
        assert env["NATS_SERVER_NAME"] == node
        users = [*accounts.SERVICES, accounts.OPS_USER, accounts.SYSTEM_USER, *accounts.DEFAULT_API_CLIENTS]
        for user in users:
            assert env.get(accounts.password_env(user)), f"{node}: no password for NATS user {user}"
        assert f"nats-route://{node}:6222" in cluster_conf
        assert "js-enabled-only" in " ".join(svc["healthcheck"]["test"])
    assert list(accounts.CLUSTER_NODES) == list(NATS_NODES)


@pytest.mark.parametrize("which", ["base", "cpu"])
def test_workers_and_the_autoscaler_fit_together(which: str) -> None:
    model = MODELS[which]
    mesh = meshserve_services(model)
    (autoscaler_name, (_, scaler)), = [(n, a) for n, a in mesh.items() if a[0] == "autoscaler"]
    (worker_name, (_, worker)), = [(n, a) for n, a in mesh.items() if a[0] == "worker"]
    w = services(model)[worker_name]
    assert scaler.driver == "compose" and scaler.compose_project == "meshserve"
    assert scaler.compose_service == worker_name
    assert scaler.pool == [worker.model], "the autoscaler scales the pool the workers serve"
    # The compose driver: a drained worker exits 0 and stays down; Docker's default hostname.
    assert w["restart"] == "on-failure"
    assert "hostname" not in w and "container_name" not in w
    assert "--worker-id" not in w["command"]
    assert w.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert duration_s(w["stop_grace_period"]) > worker.drain_timeout, "SIGTERM drains before SIGKILL"
    assert duration_s(w["stop_grace_period"]) > scaler.drain_timeout
    # It runs compose on files that are mounted where it looks for them.
    a = services(model)[autoscaler_name]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in a["volumes"]}
    assert mounts["/var/run/docker.sock"] == "/var/run/docker.sock"
    expected = ["docker-compose.yml"] + (["docker-compose.cpu.yml"] if which == "cpu" else [])
    assert [Path(f).name for f in scaler.compose_file] == expected
    for f in scaler.compose_file:
        folder, _, filename = f.rpartition("/")
        assert (COMPOSE_DIR / mounts[folder] / filename).is_file()
    devices = w.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if which == "base":
        assert worker.engine == "vllm"
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert w["image"].startswith("meshserve-worker:") and w["build"]["args"]["VARIANT"] == "worker"
    else:
        assert worker.engine == "sim"
        assert devices == [], "sim workers need no GPU"
        assert w["image"] == services(model)["gateway-1"]["image"] and w["build"]["args"]["VARIANT"] == "control"


def test_metering_writes_to_the_postgres_service() -> None:
    model = MODELS["base"]
    (_, metering), = [a for a in meshserve_services(model).values() if a[0] == "metering"]
    url = metering.ledger_url
    m = re.fullmatch(r"postgresql://([^:]+):([^@]+)@([^:/]+):(\d+)/(\w+)", url)
    assert m, url
    user, password, host, port, db = m.groups()
    pg = services(model)[host]
    env = env_of(pg)
    assert (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"], env["POSTGRES_DB"], port) == (user, password, db, "5432")
    assert "postgres" in depends_on(services(model)["metering"])


def test_prometheus_scrapes_what_the_services_serve() -> None:
    model = MODELS["base"]
    mesh = meshserve_services(model)
    config = yaml.safe_load((COMPOSE_DIR / "prometheus" / "prometheus.yml").read_text())
    scraped: set[str] = set()
    for job in config["scrape_configs"]:
        targets = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        targets += [f"{n}:{sd['port']}" for sd in job.get("dns_sd_configs", []) for n in sd["names"]]
        for target in targets:
            host, port = target.split(":")
            assert host in services(model), f"{job['job_name']}: no service {host}"
            scraped.add(host)
            service, args = mesh[host]
            if service == "worker" and "metrics_port" not in vars(args):
                continue  # the worker's metrics port arrives with its vLLM-compatible metrics
            listens = listening_ports(service, args)
            assert int(port) in listens, f"{job['job_name']}: {host} listens on {sorted(listens)}, not {port}"
            assert listens[int(port)] == "0.0.0.0"
            if service == "worker":
                assert int(port) == args.metrics_port
    metrics_services = {n for n, (s, a) in mesh.items() if getattr(a, "metrics_port", None) or s == "gateway"}
    assert metrics_services <= scraped, f"not scraped: {metrics_services - scraped}"


def test_dashboard_shows_the_slo_histograms_and_engine_gauges() -> None:
    dashboard = json.loads((COMPOSE_DIR / "grafana" / "dashboards" / "meshserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"\b(?:meshserve|vllm):[a-z0-9_]+", e)}
    gateway_metrics = {m.name for m in GatewayMetrics().registry.collect()}
    gateway_metrics |= {f"{n}_total" for n in gateway_metrics}  # counters are collected without _total
    for name in used:
        known = gateway_metrics if name.startswith("meshserve:") else VLLM_METRICS
        assert name in known, f"the dashboard queries {name}, which nothing exports"
    # Each selector's labels are ones the series has: the engine panels filtered on the
    # gateway's "model" label, which the workers' vllm: series do not have ("model_name").
    series = exported_labels(GatewayMetrics().registry) | exported_labels(WorkerMetrics("m", "vllm").registry)
    for expr in exprs:
        for name, matchers in selectors(expr):
            assert name in series and set(matchers) <= series[name], (name, matchers, series.get(name))
    required = {"meshserve:time_to_first_token_seconds", "meshserve:time_per_output_token_seconds",
                "meshserve:e2e_request_latency_seconds", "meshserve:gateway_requests_total",
                "meshserve:gateway_streams_in_flight", *VLLM_METRICS}
    assert required <= used, f"missing from the dashboard: {required - used}"
    # SLO thresholds are bucket edges of the gateway's histograms, or the ratio reads nothing.
    from services.gateway.metrics import TPOT_BUCKETS, TTFT_BUCKETS

    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {float(x) for x in variables["ttft_slo"]["query"].split(",")} <= set(TTFT_BUCKETS)
    assert {float(x) for x in variables["tpot_slo"]["query"].split(",")} <= set(TPOT_BUCKETS)
    datasource = yaml.safe_load((COMPOSE_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    url = datasource["datasources"][0]["url"]
    assert url == "http://prometheus:9090" and 9090 in container_ports(services(MODELS["base"])["prometheus"])


def test_collector_receives_otlp_http_and_exports_to_jaeger() -> None:
    config = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    pipeline = config["service"]["pipelines"]["traces"]
    assert "otlp" in pipeline["receivers"]
    for exporter in pipeline["exporters"]:
        assert exporter in config["exporters"]
        endpoint = config["exporters"][exporter].get("endpoint")
        if endpoint:
            assert endpoint.split(":")[0] in services(MODELS["base"])
    for processor in pipeline["processors"]:
        assert processor in config["processors"]


def test_dockerfile() -> None:
    text = (COMPOSE_DIR / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M | re.I))
    assert {"base-control", "base-worker"} <= stages
    assert re.search(r"^FROM base-\$\{VARIANT\}\s*$", text, re.M), "the build argument VARIANT selects the base"
    image = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\d+)\.(\d+)\.(\d+)\s*$", text, re.M)
    assert image, "VLLM_IMAGE is a released vllm/vllm-openai:vX.Y.Z"
    bound = re.search(r'"vllm>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert bound
    assert tuple(map(int, image.groups()))[:2] >= tuple(map(int, bound.groups())), \
        "the worker image's vLLM is older than the version pyproject requires (and tests)"
    # Named volumes copy the image's directory (and its owner) at first mount: these must
    # exist, owned by the unprivileged user, or it cannot write weights and tokenizers.
    assert "/home/meshserve/.cache/huggingface" in text and "/home/meshserve/.cache/meshserve" in text
    user = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert user and not user[-1].startswith(("0", "root")), "runs as a non-root user"
    assert re.search(r'^HEALTHCHECK .*CMD \["meshserve-healthcheck"\]', text, re.M)
    for source in re.findall(r"^COPY\s+(?:--chmod=\S+\s+)?(\S+)\s+\S+$", text, re.M):
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    ignore = (COMPOSE_DIR / "Dockerfile.dockerignore").read_text()
    for source in re.findall(r"^COPY\s+(?:--chmod=\S+\s+)?(\S+)\s+\S+$", text, re.M):
        assert f"!{source}" in ignore or f"!{source}/" in ignore, f"{source} is ignored by the build context"


@pytest.mark.parametrize("which", ["base", "cpu"])
def test_services_get_time_to_drain(which: str) -> None:
    """Docker sends SIGTERM, then SIGKILL after stop_grace_period (10 s unless set)."""
    model = MODELS[which]
    for name, (service, args) in meshserve_services(model).items():
        svc = services(model)[name]
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM"
        grace = duration_s(svc.get("stop_grace_period", "10s"))
        # The autoscaler's --drain-timeout is what the workers it drains get; its own drain is 30 s.
        own = 30.0 if service in ("autoscaler", "gateway", "router", "admission") else float(args.drain_timeout)
        assert grace > own, f"{name}: SIGKILL after {grace}s, before its {own}s drain ends"


@pytest.mark.parametrize("which", ["base", "cpu"])
def test_with_default_passwords_only_the_gateways_listen_beyond_the_host(which: str) -> None:
    """Unset passwords default to `<user>-dev-secret`: whatever those guard (NATS, its
    monitoring, the dashboards with Grafana's admin/admin) is published on loopback only."""
    public = {name for name, svc in services(models()[which]).items()
              for spec in svc.get("ports") or [] if not str(spec).startswith("127.0.0.1:")}
    assert public == {"gateway-1", "gateway-2"}
    # NATS_BIND opens NATS for API clients elsewhere, once .env holds real passwords.
    nats = services(models({"NATS_BIND": "0.0.0.0"})[which])["nats-1"]
    assert any(str(p).startswith("0.0.0.0:4222:") for p in nats["ports"])
