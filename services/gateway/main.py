"""The gateway: OpenAI-compatible HTTP/SSE, WebSocket and NATS API front door.

``meshserve serve gateway --port 8080`` (several replicas may run behind any load
balancer; each answers the NATS API in one queue group).
"""

from __future__ import annotations

import argparse
import json
import os

from bus import run_service

DEV_KEY_FILE_ENV = "MESHSERVE_DEV_KEY_FILE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (0 picks a free one)")
    parser.add_argument("--gateway-id", default="", help="stable id (default: gateway-host-random)")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate: serve HTTPS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--trusted-proxy", action="append", default=[], metavar="CIDR",
                        help="honour X-Forwarded-For from these proxies (repeatable)")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--max-in-flight", type=int, default=4096, help="streams beyond this are shed with 429")
    parser.add_argument("--stall-timeout", type=float, default=30.0,
                        help="seconds without a chunk before the worker counts as lost and the request migrates")
    parser.add_argument("--stream-buffer", type=int, default=4096,
                        help="chunks buffered for one slow client before it is cut")
    parser.add_argument("--max-migrations", type=int, default=2, help="times one request may move to another replica")
    parser.add_argument("--resume-window", type=float, default=60.0,
                        help="seconds a resumable request (X-Meshserve-Resumable) outlives its lost client")
    parser.add_argument("--models-config", default=None,
                        help='JSON: {"limits": {MODEL: {max_tokens_cap: ...}}, "aliases": {ALIAS: MODEL}}')
    parser.add_argument("--admission-unreachable", choices=["open", "closed", "grace"], default="grace",
                        help="what to do when no admission service answers (grace: open for --admission-grace s)")
    parser.add_argument("--admission-grace", type=float, default=30.0)
    parser.add_argument("--dev-key-file", default=None, metavar="PATH",
                        help=f"development key file: GET /dev-key hands it to browsers on this host only "
                             f"(env {DEV_KEY_FILE_ENV}; meshserve up passes its own)")


def build_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import msgspec

    from .path import PathConfig
    from .service import GatewayConfig
    from .validation import ModelLimits

    limits: dict[str, ModelLimits] = {}
    aliases: dict[str, str] = {}
    if args.models_config:
        with open(args.models_config) as f:
            raw = json.load(f)
        limits = {m: msgspec.convert(v, ModelLimits) for m, v in raw.get("limits", {}).items()}
        aliases = dict(raw.get("aliases", {}))
    return GatewayConfig(
        host=args.host, port=args.port, gateway_id=args.gateway_id, tls_cert=args.tls_cert, tls_key=args.tls_key,
        trusted_proxies=tuple(args.trusted_proxy), max_body_bytes=args.max_body_bytes, max_in_flight=args.max_in_flight,
        stall_timeout_s=args.stall_timeout, max_migrations=args.max_migrations, stream_buffer_chunks=args.stream_buffer, resume_window_s=args.resume_window, model_limits=limits, aliases=aliases,
        path=PathConfig(admission_unreachable=args.admission_unreachable, admission_grace_s=args.admission_grace),
        dev_key_file=args.dev_key_file or os.environ.get(DEV_KEY_FILE_ENV) or None,
    )


def run(args: argparse.Namespace) -> int:
    from .service import GatewayService

    config = build_config(args)
    return run_service(lambda: GatewayService(config))
