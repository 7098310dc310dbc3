"""Who counts as "on this machine": the test for handing out the development key (no I/O).

``meshserve up`` writes a development key and the chat page offers it, but only to a
browser on the gateway's own host. A request qualifies when its TCP peer is a loopback
address, no proxy header says it was forwarded for someone else, its ``Host`` names a
loopback host (a DNS-rebinding page reaches 127.0.0.1 under a foreign name) and the
browser does not flag it as cross-site.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
_FORWARDED_FOR = re.compile(r'for\s*=\s*"?\[?([^\]";,]+)', re.I)


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip()).is_loopback
    except ValueError:
        return False


def _host_is_loopback(host: str) -> bool:
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8080
        name = host[1:].partition("]")[0]
    elif host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        name = host.partition(":")[0]
    else:
        name = host
    return name in _LOOPBACK_NAMES or name.endswith(".localhost") or is_loopback(name)


def is_local_request(peer: str | None, headers: Mapping[str, str]) -> bool:
    """Whether a request comes from a client on this host (see the module docstring).

    ``headers`` is looked up by canonical name (aiohttp's headers are case-insensitive).
    """
    if not peer or not is_loopback(peer):
        return False
    forwarded_for = headers.get("X-Forwarded-For")
    if forwarded_for is not None and not all(is_loopback(h) for h in forwarded_for.split(",")):
        return False
    real_ip = headers.get("X-Real-IP")
    if real_ip is not None and not is_loopback(real_ip):
        return False
    forwarded = headers.get("Forwarded")
    if forwarded is not None:
        hops = _FORWARDED_FOR.findall(forwarded)
        if not hops or not all(is_loopback(h.partition(":")[0] if h.count(":") == 1 else h) for h in hops):
            return False
    if not _host_is_loopback(headers.get("Host", "")):
        return False
    return headers.get("Sec-Fetch-Site", "same-origin") in ("same-origin", "none")
