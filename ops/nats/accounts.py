"""Who may publish and subscribe to what: the one definition of meshserve's NATS permissions.

Every meshserve service connects as its own user in the account ``MESH`` (JetStream
enabled), with the subjects its code uses and nothing else; operators' tools connect as
``ops``; external NATS API clients get a user each that can request ``<root>.api.>`` and
read only its own inbox prefix ``_INBOX_<user>.>`` (nats-py: ``inbox_prefix=``). The
system account ``SYS`` carries the server's own traffic.

Subjects are derived from ``proto.subjects.Subjects`` (wildcards are made by calling its
methods with placeholder tokens), so a change of subject layout changes the permissions
with it. From these definitions come the checked-in ``accounts.conf`` (passwords are
environment references, resolved by nats-server at start), ``cluster.conf`` (a node of the
3-node cluster of the compose deployment) and ``PERMISSIONS.md``; tests render the same
definitions with literal passwords for a loopback server. Regenerate after a change::

    python -m ops.nats.accounts --write
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ops.natsserver import (
    MAX_PAYLOAD,
    MESH_ACCOUNT,
    SYSTEM_ACCOUNT,
    connection_event_exports,
    connection_event_imports,
    indent,
)
from proto.subjects import Subjects
from services.common.cli_types import subject_root

HERE = Path(__file__).resolve().parent

ACCOUNT = MESH_ACCOUNT
SERVICES: tuple[str, ...] = ("gateway", "router", "admission", "metering", "autoscaler", "worker")
OPS_USER = "ops"
SYSTEM_USER = "sys"
# One example API client user ships with the configs; add more with --api-client.
DEFAULT_API_CLIENTS: tuple[str, ...] = ("app",)
# nats-micro service names are meshserve-<service> (bus.runner.Service.start).
MICRO_PREFIX = "meshserve-"
# The gateway streams a NATS API reply as many messages to one reply subject: the
# permission to answer a request lasts this long and this many messages. Each open
# permission costs the server a little memory per request, for up to ``expires``.
GATEWAY_RESPONSES = {"max": 100_000, "expires": "15m"}


@dataclass(frozen=True, slots=True)
class Rule:
    subject: str
    why: str


@dataclass(frozen=True, slots=True)
class UserPermissions:
    user: str
    role: str  # a service name, "ops" or "api-client"
    publish: tuple[Rule, ...]
    subscribe: tuple[Rule, ...]
    # None: no reply permission; {} : one reply per request received; else max/expires.
    allow_responses: Mapping[str, object] | None = None
    all_subjects: bool = False  # the ops user: publish and subscribe ">"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def publish_subjects(self) -> list[str]:
        return _unique(r.subject for r in self.publish)

    @property
    def subscribe_subjects(self) -> list[str]:
        return _unique(r.subject for r in self.subscribe)


def _unique(items: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for item in items:
        seen.setdefault(item, None)
    return list(seen)


def wildcard(method: Callable[..., str], arity: int) -> str:
    """``method``'s subject with each argument a ``*`` token (e.g. ``mesh.worker.*.generate``)."""
    placeholders = [f"zzwildcard{i}zz" for i in range(arity)]
    subject = method(*placeholders)
    tokens = subject.split(".")
    for p in placeholders:
        if tokens.count(p) != 1:
            raise ValueError(f"{method.__name__}: argument is not one whole subject token in {subject!r}")
    return ".".join("*" if t in placeholders else t for t in tokens)


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def admission_buckets(subjects: Subjects) -> tuple[str, str]:
    from services.admission.lease import lease_bucket_name, state_bucket_name

    return lease_bucket_name(subjects), state_bucket_name(subjects)


def provisioned_streams(subjects: Subjects) -> list[str]:
    """Streams every service creates or updates at start (``bus.provision.provision``)."""
    return [
        subjects.tokens_stream,
        subjects.usage_stream,
        subjects.capacity_stream,
        kv_stream(subjects.workers_bucket),
        kv_stream(subjects.keys_bucket),
        kv_stream(subjects.adapters_bucket),
        kv_stream(subjects.requests_bucket),
    ]


def _provision(streams: Sequence[str]) -> list[Rule]:
    rules = [Rule("$JS.API.INFO", "JetStream account info (start-up checks)")]
    for s in streams:
        why = f"create or update stream {s} at start (idempotent provisioning)"
        rules += [Rule(f"$JS.API.STREAM.INFO.{s}", why), Rule(f"$JS.API.STREAM.CREATE.{s}", why),
                  Rule(f"$JS.API.STREAM.UPDATE.{s}", why)]
    return rules


def _read(stream: str, why: str) -> list[Rule]:
    """Consumers on ``stream`` (ordered, durable pull) and direct gets (KV ``get``)."""
    return [
        Rule(f"$JS.API.STREAM.INFO.{stream}", why),
        Rule(f"$JS.API.STREAM.MSG.GET.{stream}", why),
        Rule(f"$JS.API.DIRECT.GET.{stream}", why),
        Rule(f"$JS.API.DIRECT.GET.{stream}.>", why),
        Rule(f"$JS.API.CONSUMER.CREATE.{stream}", why),
        Rule(f"$JS.API.CONSUMER.CREATE.{stream}.>", why),
        Rule(f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*", why),
        Rule(f"$JS.API.CONSUMER.INFO.{stream}.*", why),
        Rule(f"$JS.API.CONSUMER.DELETE.{stream}.*", why),
        Rule(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*", why),
        Rule(f"$JS.FC.{stream}.>", "flow-control replies of push consumers"),
    ]


def _kv_read(bucket: str, why: str) -> list[Rule]:
    return _read(kv_stream(bucket), why)


def _kv_write(bucket: str, why: str) -> list[Rule]:
    return [Rule(f"$KV.{bucket}.>", why), *_kv_read(bucket, why)]


def obj_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _tokenizers_read(subjects: Subjects) -> list[Rule]:
    return _read(obj_stream(subjects.tokenizers_bucket), "fetch a model's tokenizer this host cannot read (bus.tokenizers)")


def _tokenizers_write(subjects: Subjects) -> list[Rule]:
    bucket, stream = subjects.tokenizers_bucket, obj_stream(subjects.tokenizers_bucket)
    why = "store its model's tokenizer files for hosts without them (bus.tokenizers)"
    return [*_provision([stream]), Rule(f"$O.{bucket}.C.>", why), Rule(f"$O.{bucket}.M.>", why), *_read(stream, why)]


def _common(subjects: Subjects, service: str) -> tuple[list[Rule], list[Rule]]:
    """What every service needs: inbox, NATS micro discovery, provisioning, health check."""
    micro = MICRO_PREFIX + service
    publish = [
        *_provision(provisioned_streams(subjects)),
        Rule(f"$SRV.PING.{micro}", "the container health check pings its own service"),
    ]
    subscribe = [
        Rule("_INBOX.>", "replies to its own requests, JetStream acks and consumer deliveries"),
        Rule("$SRV.*", "NATS micro discovery ($SRV.PING|INFO|STATS)"),
        Rule(f"$SRV.*.{micro}", "NATS micro discovery by service name"),
        Rule(f"$SRV.*.{micro}.*", "NATS micro discovery by instance"),
    ]
    return publish, subscribe


def service_permissions(subjects: Subjects) -> dict[str, UserPermissions]:
    s = subjects
    generate = wildcard(s.worker_generate, 1)
    cancel = wildcard(s.worker_cancel, 1)
    probe = wildcard(s.worker_probe, 1)
    resend = wildcard(s.worker_resend, 1)
    control = wildcard(s.worker_control, 1)
    kv_snapshot = wildcard(s.worker_kv_snapshot, 1)
    prefill = wildcard(s.worker_prefill, 1)
    tokens = wildcard(s.tokens, 2)
    placements = wildcard(s.placement, 2)
    gauges = wildcard(s.gauges, 2)
    kv_events = wildcard(s.kv_events, 2)
    usage = wildcard(s.usage, 1)
    lease, state = admission_buckets(s)
    registry = "worker registry watch"
    # Every registry watcher also hears a worker's connection close (its death, at once).
    connections = [Rule(s.client_disconnected, "client disconnect advisories (a worker's death, noticed at once)"),
                   Rule(s.client_connected, "client connect advisories (a worker back after a NATS failover)")]

    roles: dict[str, tuple[list[Rule], list[Rule], Mapping[str, object] | None]] = {
        "gateway": (
            [
                Rule(s.admission_check, "admission verdict for each request"),
                Rule(s.admission_ttft, "TTFT of each admitted request, for admission's calibration"),
                Rule(s.router_route, "placement by the router"),
                Rule(generate, "direct placement while no router answers"),
                Rule(cancel, "cancel on client disconnect"),
                Rule(probe, "ask a worker about a silent request before calling it stalled"),
                Rule(resend, "ask a worker to send again chunks that never reached TOKENS"),
                Rule(usage, "usage event of a request that ended before a worker took it"),
                Rule(s.metering_usage, "GET /v1/usage"),
                Rule(s.gateway_cancel, "a NATS API cancel, to the gateway relaying the request"),
                *_read(s.tokens_stream, "gap fill and resume from TOKENS"),
                *_kv_read(s.workers_bucket, registry),
                *_kv_read(s.keys_bucket, "API key lookups and revocation watch"),
                *_kv_read(s.adapters_bucket, "LoRA adapters: a model name's base pool, path and size"),
                *_kv_write(s.requests_bucket, "resumable request records"),
                # Made by the gateway alone, on first use (its TTL is a gateway setting).
                *[Rule(f"$JS.API.STREAM.{op}.{kv_stream(s.responses_bucket)}", "create or update the stored-responses bucket")
                  for op in ("CREATE", "UPDATE")],
                *_kv_write(s.responses_bucket, "stored /v1/responses responses: create, retrieve, continue, delete"),
                *_tokenizers_read(s),
            ],
            [
                Rule(s.api_chat, "NATS API (queue group gateway)"),
                Rule(s.api_completions, "NATS API (queue group gateway)"),
                Rule(s.api_cancel, "NATS API cancel (queue group gateway)"),
                Rule(s.gateway_cancel, "NATS API cancels other gateways received (each answers for its own requests)"),
                Rule(tokens, "token chunks of its own requests (mesh.tokens.<gateway>.*)"),
                Rule(placements, "placements of requests admission forwarded (mesh.placed.<gateway>.*)"),
                *connections,
            ],
            GATEWAY_RESPONSES,
        ),
        "router": (
            [
                Rule(generate, "forward a placed request to its worker"),
                Rule(cancel, "cancel a forward that timed out"),
                Rule(kv_snapshot, "KV index resync after an event gap"),
                *_kv_read(s.workers_bucket, registry),
                *_tokenizers_read(s),
            ],
            [
                Rule(s.router_route, "route endpoint (queue group router)"),
                *connections,
                Rule(s.gauges_all, "worker load gauges"),
                Rule(s.kv_events_all, "worker KV cache events"),
            ],
            {},
        ),
        "admission": (
            [
                Rule(s.router_route, "an admitted request forwarded to the router (its placement goes to the gateway)"),
                Rule(s.autoscaler_demand, "what it refused for want of capacity, to the autoscalers"),
                Rule(kv_snapshot, "KV index resync after an event gap"),
                *_provision([kv_stream(lease), kv_stream(state)]),
                *_kv_write(lease, "leader lease"),
                *_kv_write(state, "limiter checkpoint for the next leader"),
                *_read(s.usage_stream, "usage reconciliation (ordered consumer)"),
                *_kv_read(s.workers_bucket, registry),
            ],
            [
                Rule(s.admission_check, "check endpoint (queue group admission, leader only)"),
                *connections,
                Rule(s.admission_ttft, "gateways' TTFT reports (calibration of predictions)"),
                Rule(s.gauges_all, "worker load gauges"),
                Rule(s.kv_events_all, "worker KV cache events"),
            ],
            {},
        ),
        "metering": (
            [
                *_read(s.usage_stream, "durable pull consumer on USAGE"),
                Rule(f"$JS.ACK.{s.usage_stream}.>", "ack usage events after the ledger commit"),
                *_read(s.capacity_stream, "durable pull consumer on CAPACITY"),
                Rule(f"$JS.ACK.{s.capacity_stream}.>", "ack capacity events after the ledger commit"),
            ],
            [Rule(s.metering_usage, "usage and spend queries"),
             Rule(s.metering_fleet, "fleet cost queries (meshserve usage --fleet)")],
            {},
        ),
        "autoscaler": (
            [
                Rule(control, "drain commands"),
                *_kv_read(s.workers_bucket, registry),
            ],
            [
                Rule(s.autoscaler_status, "status endpoint (meshserve status)"),
                *connections,
                Rule(s.gauges_all, "worker load gauges"),
                Rule(s.autoscaler_demand, "admission's refused demand per pool"),
            ],
            {},
        ),
        "worker": (
            [
                Rule(tokens, "token chunks into TOKENS"),
                Rule(gauges, "load gauges"),
                Rule(kv_events, "KV cache events"),
                Rule(usage, "one usage event per request into USAGE"),
                Rule(s.capacity_all, "capacity events (accelerator and busy time) into CAPACITY"),
                Rule(prefill, "a long prompt's prefill on a prefill worker (P/D split)"),
                Rule(cancel, "cancel a prefill it stopped waiting for"),
                *_kv_write(s.workers_bucket, "heartbeat in the worker registry"),
                *_tokenizers_write(s),
            ],
            [
                Rule(generate, "generate endpoint"),
                Rule(cancel, "cancel endpoint"),
                Rule(s.client_disconnected, "client disconnect advisories (its gateway's death: stop what nobody reads)"),
                Rule(s.client_connected, "client connect advisories (a gateway back after a NATS failover)"),
                Rule(probe, "request probe endpoint"),
                Rule(resend, "chunk resend endpoint"),
                Rule(control, "drain and control endpoint"),
                Rule(kv_snapshot, "KV snapshot endpoint"),
                Rule(prefill, "prefill endpoint (a prefill worker's)"),
            ],
            {},
        ),
    }
    out: dict[str, UserPermissions] = {}
    for name in SERVICES:
        publish, subscribe, responses = roles[name]
        common_pub, common_sub = _common(s, name)
        out[name] = UserPermissions(
            user=name, role=name, publish=(*common_pub, *publish), subscribe=(*common_sub, *subscribe),
            allow_responses=responses,
        )
    return out


def api_client_permissions(subjects: Subjects, user: str) -> UserPermissions:
    return UserPermissions(
        user=user,
        role="api-client",
        publish=(Rule(subjects.api_all, "OpenAI-shaped requests to any gateway"),),
        subscribe=(Rule(f"{inbox_prefix(user)}.>", "its own replies only (connect with inbox_prefix)"),),
        notes=("cannot read token streams, usage, gauges or other clients' inboxes",),
    )


def inbox_prefix(user: str) -> str:
    return f"_INBOX_{user}"


def ops_permissions() -> UserPermissions:
    return UserPermissions(
        user=OPS_USER, role="ops", publish=(Rule(">", "operator tools"),), subscribe=(Rule(">", "operator tools"),),
        all_subjects=True, notes=("meshserve keys / status / usage / bench and the nats CLI",),
    )


def all_users(subjects: Subjects, api_clients: Sequence[str] = DEFAULT_API_CLIENTS) -> list[UserPermissions]:
    return [*service_permissions(subjects).values(), ops_permissions(),
            *(api_client_permissions(subjects, c) for c in api_clients)]


# ------------------------------------------------------------------------------- rendering


def password_env(user: str) -> str:
    """The environment variable nats-server reads ``user``'s password from."""
    return "NATS_PASSWORD_" + user.upper().replace("-", "_")


def _quote(value: str) -> str:
    return json.dumps(value)  # NATS config strings in double quotes: "$JS..." stays literal


def _list(values: Sequence[str], indent: str) -> str:
    return "[\n" + "".join(f"{indent}  {_quote(v)}\n" for v in values) + f"{indent}]"


def _password(user: str, passwords: Mapping[str, str] | None) -> str:
    if passwords is None:
        return "$" + password_env(user)  # unquoted: a variable, looked up in the environment
    return _quote(passwords[user])


def _user_block(p: UserPermissions, passwords: Mapping[str, str] | None) -> str:
    ind = "      "
    lines = [f"{ind}{{", f"{ind}  user: {_quote(p.user)}", f"{ind}  password: {_password(p.user, passwords)}"]
    if not p.all_subjects:
        lines.append(f"{ind}  permissions: {{")
        lines.append(f"{ind}    publish: {{ allow: {_list(p.publish_subjects, ind + '    ')} }}")
        lines.append(f"{ind}    subscribe: {{ allow: {_list(p.subscribe_subjects, ind + '    ')} }}")
        if p.allow_responses is not None:
            if p.allow_responses:
                body = ", ".join(f"{k}: {_quote(v) if isinstance(v, str) else v}" for k, v in p.allow_responses.items())
                lines.append(f"{ind}    allow_responses: {{ {body} }}")
            else:
                lines.append(f"{ind}    allow_responses: true")
        lines.append(f"{ind}  }}")
    lines.append(f"{ind}}}")
    return "\n".join(lines)


def render_accounts(
    root: str = "mesh",
    *,
    passwords: Mapping[str, str] | None = None,
    api_clients: Sequence[str] = DEFAULT_API_CLIENTS,
) -> str:
    """The ``accounts`` block and ``system_account``; passwords None → environment references."""
    subjects = Subjects(root)
    users = all_users(subjects, api_clients)
    blocks = ",\n".join(_user_block(u, passwords) for u in users)
    return (
        "# meshserve accounts: one user per service with the subjects it uses, operators' tools,\n"
        "# API clients confined to mesh.api.> and their own inbox. Generated by\n"
        "# `python -m ops.nats.accounts --write` from ops/nats/accounts.py: edit that, not this.\n"
        f"# Subject root: {root}\n"
        "accounts {\n"
        f"  {ACCOUNT} {{\n"
        "    jetstream: enabled\n"
        "    users: [\n"
        f"{blocks}\n"
        "    ]\n"
        f"{indent(connection_event_imports(root), 4)}\n"
        "  }\n"
        f"  {SYSTEM_ACCOUNT} {{\n"
        f"    users: [ {{ user: {_quote(SYSTEM_USER)}, password: {_password(SYSTEM_USER, passwords)} }} ]\n"
        f"    {connection_event_exports()}\n"
        "  }\n"
        "}\n"
        f"system_account: {SYSTEM_ACCOUNT}\n"
    )


CLUSTER_NODES: tuple[str, ...] = ("nats-1", "nats-2", "nats-3")


def render_cluster_config(nodes: Sequence[str] = CLUSTER_NODES, cluster_name: str = "meshserve") -> str:
    """One node of the compose deployment's JetStream cluster; ``NATS_SERVER_NAME`` names it."""
    routes = ", ".join(_quote(f"nats-route://{n}:6222") for n in nodes)
    return (
        "# A node of meshserve's 3-node NATS JetStream cluster (docker compose). Generated by\n"
        "# `python -m ops.nats.accounts --write`. Each container sets NATS_SERVER_NAME and the\n"
        "# NATS_PASSWORD_<USER> variables that accounts.conf refers to.\n"
        "server_name: $NATS_SERVER_NAME\n"
        'listen: "0.0.0.0:4222"\n'
        "http_port: 8222\n"
        f"max_payload: {MAX_PAYLOAD}\n"
        "max_pending: 67108864\n"
        "jetstream {\n"
        '  store_dir: "/data/jetstream"\n'
        "  max_memory_store: 1073741824\n"
        "  max_file_store: 10737418240\n"
        "}\n"
        "cluster {\n"
        f"  name: {_quote(cluster_name)}\n"
        '  listen: "0.0.0.0:6222"\n'
        f"  routes: [{routes}]\n"
        "}\n"
        "include ./accounts.conf\n"
    )


def render_markdown(root: str = "mesh", api_clients: Sequence[str] = DEFAULT_API_CLIENTS) -> str:
    subjects = Subjects(root)
    out = [
        "# NATS permissions of meshserve",
        "",
        "Generated by `python -m ops.nats.accounts --write` from `ops/nats/accounts.py`, the one",
        "definition the configs (`accounts.conf`, `cluster.conf`) are rendered from. Subject root:",
        f"`{root}`. All users live in the account `{ACCOUNT}` (JetStream enabled); `{SYSTEM_ACCOUNT}` is the",
        "system account. Passwords come from the environment of nats-server: user `gateway` reads",
        f"`{password_env('gateway')}`, and so on.",
        "",
        "Every service also may: subscribe `_INBOX.>` (its replies, JetStream acks, consumer",
        "deliveries) and `$SRV.*` / `$SRV.*.meshserve-<service>[.*]` (NATS micro discovery); publish",
        "`$SRV.PING.meshserve-<service>` (its health check) and `$JS.API.INFO` plus",
        "`$JS.API.STREAM.INFO|CREATE|UPDATE.<stream>` for the streams every service provisions at",
        f"start ({', '.join(provisioned_streams(subjects))}); and answer the requests it receives",
        "(`allow_responses`: one reply each; the gateway streams up to "
        f"{GATEWAY_RESPONSES['max']:,} messages within {GATEWAY_RESPONSES['expires']}).",
        "No service may delete or purge a stream.",
        "",
    ]
    common_pub = {r.subject for svc in SERVICES for r in _common(subjects, svc)[0]}
    common_sub = {r.subject for svc in SERVICES for r in _common(subjects, svc)[1]}
    for p in all_users(subjects, api_clients):
        out += [f"## `{p.user}` ({p.role})", ""]
        if p.all_subjects:
            out += ["Publish and subscribe `>`: " + "; ".join(p.notes) + ".", ""]
            continue
        out += ["| direction | subject | why |", "| --- | --- | --- |"]
        for direction, rules, common in (("publish", p.publish, common_pub), ("subscribe", p.subscribe, common_sub)):
            shown: dict[str, list[str]] = {}
            for r in rules:
                if r.subject in common and p.role != "api-client":
                    continue
                shown.setdefault(r.why, []).append(r.subject)
            for why, subjects_ in shown.items():
                cell = "<br>".join(f"`{x}`" for x in _unique(subjects_))
                out.append(f"| {direction} | {cell} | {why} |")
        out.append("")
        if p.role == "api-client":
            out += [
                f"Connect with `inbox_prefix=\"{inbox_prefix(p.user)}\"` (nats-py) or `--inbox-prefix` (nats CLI).",
                *(f"- {n}" for n in p.notes),
                "",
            ]
    return "\n".join(out).rstrip() + "\n"


GENERATED = {"accounts.conf", "cluster.conf", "PERMISSIONS.md"}


def generated_files(root: str = "mesh", api_clients: Sequence[str] = DEFAULT_API_CLIENTS) -> dict[str, str]:
    return {
        "accounts.conf": render_accounts(root, api_clients=api_clients),
        "cluster.conf": render_cluster_config(),
        "PERMISSIONS.md": render_markdown(root, api_clients),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.nats.accounts", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=subject_root, default="mesh", help="subject root of the mesh")
    parser.add_argument("--api-client", action="append", default=[], metavar="USER",
                        help=f"an API client user (repeatable; default {', '.join(DEFAULT_API_CLIENTS)})")
    parser.add_argument("--write", action="store_true", help=f"write the configs into {HERE}")
    parser.add_argument("--out", default=None, help="write them into this folder instead")
    args = parser.parse_args(argv)
    files = generated_files(args.root, tuple(args.api_client) or DEFAULT_API_CLIENTS)
    if not (args.write or args.out):
        sys.stdout.write(files["accounts.conf"])
        return 0
    folder = Path(args.out) if args.out else HERE
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
        print(f"wrote {folder / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
