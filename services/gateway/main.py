"""The gateway: OpenAI-compatible HTTP/SSE, WebSocket and NATS API front door.

``meshserve serve gateway --port 8080`` (several replicas may run behind any load
balancer; each answers the NATS API in one queue group).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from typing import TYPE_CHECKING

from bus import RunOptions, run_service
from bus.config import default_of, file_problem, given, refuse
from bus.runner import listen_problem
from services.common.cli_types import (
    add_region_argument,
    count,
    non_negative_seconds,
    port_number,
    positive_int,
    positive_seconds,
    region_of_args,
)

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


def cidr(text: str) -> str:
    """An argparse ``type`` for ``--trusted-proxy``: an address or network (``10.0.0.0/8``)."""
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address or network (CIDR, e.g. 10.0.0.0/8): {text!r}") from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults come from GatewayConfig (None here: not given); the help quotes them.
    parser.add_argument("--host", default=None, help=f"address to listen on (0.0.0.0 in containers) {_default('host')}")
    parser.add_argument("--port", type=port_number, default=None, help=f"HTTP port (0 picks a free one) {_default('port')}")
    parser.add_argument("--gateway-id", default=None, help="stable id (default: gateway-host-random)")
    add_region_argument(parser)
    parser.add_argument("--tls-cert", default=None, help="PEM certificate: serve HTTPS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--trusted-proxy", type=cidr, action="append", default=None, metavar="CIDR",
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
    if region := region_of_args(args):
        overrides["region"] = region
    if args.trusted_proxy:
        overrides["trusted_proxies"] = tuple(args.trusted_proxy)
    dev_key_file = args.dev_key_file or os.environ.get(DEV_KEY_FILE_ENV)
    if dev_key_file:
        overrides["dev_key_file"] = dev_key_file
    # Bad input: one line, exit 2. A file that cannot be read or used is named with its option.
    try:
        overrides["oidc"] = load_oidc_config(args.oidc_config, **given(args, _OIDC_OPTIONS))
    except OSError as exc:
        refuse("gateway", file_problem("--oidc-config", args.oidc_config, exc))
    except ValueError as exc:
        refuse("gateway", f"config: {exc}")
    try:
        return load_config(args.models_config, upstream=given(args, _UPSTREAM_OPTIONS), **overrides)
    except OSError as exc:
        refuse("gateway", file_problem("--models-config", args.models_config, exc))
    except ValueError as exc:
        refuse("gateway", f"config: {exc}")


def check_tls(config: GatewayConfig) -> None:
    """The certificate and key load, before the gateway connects to NATS: a missing file or
    one that is not PEM is one line naming it (exit 2), not an ``ssl`` traceback at start."""
    import ssl

    if config.tls_key and not config.tls_cert:
        refuse("gateway", "--tls-key needs --tls-cert (the certificate the key is for)")
    if not config.tls_cert:
        return
    files = [("--tls-cert", config.tls_cert)] + ([("--tls-key", config.tls_key)] if config.tls_key else [])
    contents = {}
    for option, path in files:
        try:
            with open(path, "rb") as f:
                contents[option] = f.read()
        except OSError as exc:
            refuse("gateway", f"{option} {path}: {exc.strerror or exc}")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(config.tls_cert, config.tls_key)
    except ssl.SSLError as exc:
        why = exc.reason or exc.strerror or str(exc)
        if b"-----BEGIN CERTIFICATE-----" not in contents["--tls-cert"]:
            refuse("gateway", f"--tls-cert {config.tls_cert}: not a PEM certificate")
        key_option = "--tls-key" if config.tls_key else "--tls-cert"
        if b"PRIVATE KEY-----" not in contents[key_option]:
            what = "not a PEM private key" if config.tls_key else "holds no PEM private key (give one with --tls-key)"
            refuse("gateway", f"{key_option} {config.tls_key or config.tls_cert}: {what}")
        shown = f"--tls-cert {config.tls_cert}" + (f" and --tls-key {config.tls_key}" if config.tls_key else "")
        if "KEY_VALUES_MISMATCH" in why:
            why = "the key is not the certificate's (KEY_VALUES_MISMATCH)"
        refuse("gateway", f"{shown}: cannot be used: {why}")
    except OSError as exc:  # (a password-protected key that was not unlocked, say)
        refuse("gateway", f"--tls-cert {config.tls_cert}: {exc.strerror or exc}")


def run(args: argparse.Namespace) -> int:
    from .service import GatewayService

    config = build_config(args)
    check_tls(config)
    problem = listen_problem(config.host, config.port)
    if problem:
        refuse("gateway", *problem)
    options = RunOptions.from_args(args)

    def service() -> GatewayService:
        return GatewayService(config, options.settings)

    return run_service(service, options)
