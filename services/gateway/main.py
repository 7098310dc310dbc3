"""The gateway: OpenAI-compatible HTTP/SSE, WebSocket and NATS API front door.

``meshserve serve gateway --port 8080`` (several replicas may run behind any load
balancer; each answers the NATS API in one queue group).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from bus import RunOptions, run_service
from bus.config import default_of, given
from services.common.cli_types import count, non_negative_seconds, port_number, positive_int, positive_seconds

from .config import GatewayConfig, load_config, load_oidc_config
from .upstream import UpstreamConfig

if TYPE_CHECKING:
    from .service import GatewayService

DEV_KEY_FILE_ENV = "MESHSERVE_DEV_KEY_FILE"

# option dest → GatewayConfig field
_OPTIONS = {"host": "host", "port": "port", "gateway_id": "gateway_id", "tls_cert": "tls_cert", "tls_key": "tls_key",
            "max_body_bytes": "max_body_bytes", "max_in_flight": "max_in_flight", "stall_timeout": "stall_timeout_s",
            "stream_buffer": "stream_buffer_chunks", "max_migrations": "max_migrations",
            "migration_wait": "migration_wait_s",
            "resume_window": "resume_window_s", "responses_ttl": "responses_ttl_s"}
# option dest → OidcConfig field (the rest of the section comes from --oidc-config)
_OIDC_OPTIONS = {"oidc_issuer": "issuer", "oidc_audience": "audience", "oidc_jwks_uri": "jwks_uri",
                 "oidc_jwks_file": "jwks_file"}
# option dest → UpstreamConfig field
_UPSTREAM_OPTIONS = {"admission_unreachable": "admission_unreachable", "admission_grace": "admission_grace_s",
                     "placement_path": "placement_path"}


def _default(name: str) -> str:
    return f"(default {default_of(GatewayConfig, name)})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults come from GatewayConfig (None here: not given); the help quotes them.
    parser.add_argument("--host", default=None, help=f"address to listen on (0.0.0.0 in containers) {_default('host')}")
    parser.add_argument("--port", type=port_number, default=None, help=f"HTTP port (0 picks a free one) {_default('port')}")
    parser.add_argument("--gateway-id", default=None, help="stable id (default: gateway-host-random)")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate: serve HTTPS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--trusted-proxy", action="append", default=None, metavar="CIDR",
                        help="honour X-Forwarded-For from these proxies (repeatable)")
    parser.add_argument("--max-body-bytes", type=positive_int, default=None, help=_default("max_body_bytes"))
    parser.add_argument("--max-in-flight", type=positive_int, default=None,
                        help=f"streams beyond this are shed with 429 {_default('max_in_flight')}")
    parser.add_argument("--stall-timeout", type=positive_seconds, default=None,
                        help="seconds without a chunk before the worker counts as lost and the request migrates "
                             + _default("stall_timeout_s"))
    parser.add_argument("--stream-buffer", type=positive_int, default=None,
                        help=f"chunks buffered for one slow client before it is cut {_default('stream_buffer_chunks')}")
    parser.add_argument("--max-migrations", type=count, default=None,
                        help=f"times one request may move to another replica {_default('max_migrations')}")
    parser.add_argument("--migration-wait", type=non_negative_seconds, default=None,
                        help="seconds a migrating request waits for a replica when none is ready "
                             + _default("migration_wait_s"))
    parser.add_argument("--resume-window", type=non_negative_seconds, default=None,
                        help="seconds a resumable request (X-Meshserve-Resumable) outlives its lost client "
                             + _default("resume_window_s"))
    parser.add_argument("--responses-ttl", type=non_negative_seconds, default=None,
                        help="seconds a stored /v1/responses response can be retrieved and continued (0: until deleted) "
                             + _default("responses_ttl_s"))
    parser.add_argument("--models-config", default=None,
                        help='JSON (or .toml): {"limits": {MODEL: {max_tokens_cap: ...}}, "aliases": {ALIAS: MODEL}}')
    parser.add_argument("--admission-unreachable", choices=["open", "closed", "grace"], default=None,
                        help="what to do when no admission service answers (grace: open for --admission-grace s) "
                             f"(default {default_of(UpstreamConfig, 'admission_unreachable')})")
    parser.add_argument("--admission-grace", type=non_negative_seconds, default=None,
                        help=f"(default {default_of(UpstreamConfig, 'admission_grace_s')})")
    parser.add_argument("--placement-path", choices=["admission", "gateway"], default=None,
                        help="who sends an admitted request to the router: admission, on its way (one hop fewer), "
                             "or the gateway once admission has answered "
                             f"(default {default_of(UpstreamConfig, 'placement_path')})")
    parser.add_argument("--dev-key-file", default=None, metavar="PATH",
                        help=f"development key file: GET /dev-key hands it to browsers on this host only "
                             f"(env {DEV_KEY_FILE_ENV}; meshserve up passes its own)")
    oidc = parser.add_argument_group("OIDC / JWT callers (besides API keys; see README.md)")
    oidc.add_argument("--oidc-config", default=None, metavar="PATH",
                      help="JSON (or .toml) with an oidc table: issuer, audience, claim names, tiers' default limits ...")
    oidc.add_argument("--oidc-issuer", default=None, metavar="URL",
                      help="accept bearer JWTs from this issuer (its iss; the JWKS is found through its discovery document)")
    oidc.add_argument("--oidc-audience", action="append", default=None, metavar="AUD",
                      help="an aud value this gateway's tokens carry (repeatable; required with an issuer)")
    oidc.add_argument("--oidc-jwks-uri", default=None, metavar="URL", help="the issuer's JWKS, without discovery")
    oidc.add_argument("--oidc-jwks-file", default=None, metavar="PATH",
                      help="a static JWKS file instead of fetching one (air-gapped sites)")


def build_config(args: argparse.Namespace) -> GatewayConfig:
    overrides = given(args, _OPTIONS)
    if args.trusted_proxy:
        overrides["trusted_proxies"] = tuple(args.trusted_proxy)
    dev_key_file = args.dev_key_file or os.environ.get(DEV_KEY_FILE_ENV)
    if dev_key_file:
        overrides["dev_key_file"] = dev_key_file
    try:
        overrides["oidc"] = load_oidc_config(args.oidc_config, **given(args, _OIDC_OPTIONS))
        return load_config(args.models_config, upstream=given(args, _UPSTREAM_OPTIONS), **overrides)
    except (OSError, ValueError) as exc:
        print(f"meshserve serve gateway: config: {exc}", file=sys.stderr)  # bad input: one line, exit 2
        raise SystemExit(2) from exc


def run(args: argparse.Namespace) -> int:
    from .service import GatewayService

    config = build_config(args)
    options = RunOptions.from_args(args)

    def service() -> GatewayService:
        return GatewayService(config, options.settings)

    return run_service(service, options)
