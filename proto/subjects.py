"""Every NATS subject, stream and bucket name meshserve uses, built in one place.

The root (default ``mesh``) is configurable so two meshes can share one NATS server;
stream and bucket names carry it too. Free-form values that end up inside a subject
(model names such as ``meta-llama/Llama-3.1-8B``, org ids) are escaped into a single
subject token, because ``.`` separates tokens and ``*``/``>`` are wildcards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ROOT_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_SAFE = re.compile(r"[^A-Za-z0-9_\-]")


# Escaping only ever emits safe characters and "%XX", so "%%" cannot be a value's escape.
_EMPTY = "%%"


def subject_token(value: str) -> str:
    """Escape an arbitrary string into one NATS subject token (reversible, %XX)."""
    if not value:
        return _EMPTY
    return _SAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), value)


def unescape_token(token: str) -> str:
    from urllib.parse import unquote

    return "" if token == _EMPTY else unquote(token)


def subject_root_problem(root: str) -> str | None:
    """What is wrong with ``root`` as a subject root (one NATS token), or None."""
    if _ROOT_RE.match(root):
        return None
    return f"a subject root is 1-32 letters, digits, '_' or '-', not {root!r}"


@dataclass(frozen=True, slots=True)
class Subjects:
    root: str = "mesh"

    def __post_init__(self) -> None:
        problem = subject_root_problem(self.root)
        if problem:
            raise ValueError(problem)

    # client API (queue group: any gateway answers)
    @property
    def api_chat(self) -> str:
        return f"{self.root}.api.v1.chat.completions"

    @property
    def api_completions(self) -> str:
        return f"{self.root}.api.v1.completions"

    @property
    def api_all(self) -> str:
        return f"{self.root}.api.>"

    @property
    def api_cancel(self) -> str:
        """A NATS API client's cancel of its own request (queue group: any gateway answers)."""
        return f"{self.root}.api.v1.cancel"

    @property
    def gateway_cancel(self) -> str:
        """Gateways only (every one subscribes): the gateway a cancel reached asks the one relaying the request."""
        return f"{self.root}.gateway.cancel"

    # control plane
    @property
    def admission_check(self) -> str:
        return f"{self.root}.admission.check"

    @property
    def admission_ttft(self) -> str:
        return f"{self.root}.admission.ttft"

    @property
    def router_route(self) -> str:
        return f"{self.root}.router.route"

    @property
    def metering_usage(self) -> str:
        return f"{self.root}.metering.usage"

    @property
    def metering_fleet(self) -> str:
        return f"{self.root}.metering.fleet"

    @property
    def autoscaler_status(self) -> str:
        return f"{self.root}.autoscaler.status"

    @property
    def autoscaler_demand(self) -> str:
        return f"{self.root}.autoscaler.demand"

    # one worker
    def worker_generate(self, worker_id: str) -> str:
        return f"{self.root}.worker.{subject_token(worker_id)}.generate"

    def worker_cancel(self, worker_id: str) -> str:
        return f"{self.root}.worker.{subject_token(worker_id)}.cancel"

    def worker_control(self, worker_id: str) -> str:
        return f"{self.root}.worker.{subject_token(worker_id)}.control"

    def worker_probe(self, worker_id: str) -> str:
        return f"{self.root}.worker.{subject_token(worker_id)}.probe"

    def worker_resend(self, worker_id: str) -> str:
        return f"{self.root}.worker.{subject_token(worker_id)}.resend"

    def worker_kv_snapshot(self, worker_id: str) -> str:
        return f"{self.root}.worker.{subject_token(worker_id)}.kv_snapshot"

    def worker_prefill(self, worker_id: str) -> str:
        """A decode worker → a prefill worker: compute this prompt's KV for me (P/D split)."""
        return f"{self.root}.worker.{subject_token(worker_id)}.prefill"

    # placements of requests admission forwarded to the router (core NATS, one gateway's)
    def placement(self, gateway_id: str, request_id: str) -> str:
        return f"{self.root}.placed.{subject_token(gateway_id)}.{subject_token(request_id)}"

    def placements_of_gateway(self, gateway_id: str) -> str:
        return f"{self.root}.placed.{subject_token(gateway_id)}.*"

    # token streams (JetStream TOKENS)
    def tokens(self, gateway_id: str, request_id: str) -> str:
        return f"{self.root}.tokens.{subject_token(gateway_id)}.{subject_token(request_id)}"

    @property
    def tokens_all(self) -> str:
        return f"{self.root}.tokens.>"

    def tokens_of_gateway(self, gateway_id: str) -> str:
        return f"{self.root}.tokens.{subject_token(gateway_id)}.*"

    # worker telemetry
    def gauges(self, model: str, worker_id: str) -> str:
        return f"{self.root}.gauges.{subject_token(model)}.{subject_token(worker_id)}"

    def gauges_of_model(self, model: str) -> str:
        return f"{self.root}.gauges.{subject_token(model)}.*"

    @property
    def gauges_all(self) -> str:
        return f"{self.root}.gauges.>"

    def kv_events(self, model: str, worker_id: str) -> str:
        return f"{self.root}.kv.{subject_token(model)}.{subject_token(worker_id)}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.root}.kv.>"

    # usage (JetStream USAGE)
    def usage(self, org: str) -> str:
        return f"{self.root}.usage.{subject_token(org)}"

    @property
    def usage_all(self) -> str:
        return f"{self.root}.usage.>"

    # capacity (JetStream CAPACITY): each worker's accelerator time, for the fleet's cost
    def capacity(self, worker_id: str) -> str:
        return f"{self.root}.capacity.{subject_token(worker_id)}"

    @property
    def capacity_all(self) -> str:
        return f"{self.root}.capacity.*"

    # The NATS server's own client connect / disconnect advisories, imported from the
    # system account into the mesh's (ops/nats): a worker's connection closing is its
    # death, noticed at once rather than when its heartbeat expires.
    @property
    def client_connected(self) -> str:
        return f"{self.root}.nats.connect"

    @property
    def client_disconnected(self) -> str:
        return f"{self.root}.nats.disconnect"

    # JetStream names: the default root keeps the names DESIGN.md uses.
    def _suffixed(self, name: str) -> str:
        return name if self.root == "mesh" else f"{name}_{self.root.upper()}"

    @property
    def tokens_stream(self) -> str:
        return self._suffixed("TOKENS")

    @property
    def usage_stream(self) -> str:
        return self._suffixed("USAGE")

    @property
    def capacity_stream(self) -> str:
        return self._suffixed("CAPACITY")

    @property
    def workers_bucket(self) -> str:
        return f"{self.root}_workers"

    @property
    def keys_bucket(self) -> str:
        return f"{self.root}_keys"

    @property
    def adapters_bucket(self) -> str:
        """LoRA adapters served from their base model's pool (``AdapterRecord``)."""
        return f"{self.root}_adapters"

    @property
    def requests_bucket(self) -> str:
        return f"{self.root}_requests"

    @property
    def tokenizers_bucket(self) -> str:
        """An object store: tokenizer files by digest (``bus.tokenizers``)."""
        return f"{self.root}_tokenizers"

    @property
    def responses_bucket(self) -> str:
        """Stored Responses API responses (the gateway's ``response_store``)."""
        return f"{self.root}_responses"

    def tokens_of_request(self, request_id: str) -> str:
        """Any gateway's token subject for ``request_id`` (resume on another replica)."""
        return f"{self.root}.tokens.*.{subject_token(request_id)}"
