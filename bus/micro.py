"""The two operations meshserve needs from nats.py's ``nats.micro`` that it has no public API for.

Both read nats.py's private attributes (as of nats-py 2.16); this module is the only place
in meshserve that does, so an upgrade that renames them breaks here and nowhere else.
"""

from __future__ import annotations

import contextlib

from nats.aio.msg import Msg
from nats.micro.request import Request
from nats.micro.service import Service


def request_msg(request: Request) -> Msg:
    """The NATS message behind a micro request.

    ``Request`` offers the subject, data and headers but not the reply subject, and
    meshserve answers every request through ``Bus.respond`` (the max_payload check, typed
    error replies), whose handlers take the ``Msg``.
    """
    return request._msg


async def stop_endpoint(service: Service, name: str) -> bool:
    """Stop one endpoint of a running micro service; False when it has none of that name.

    nats.py can only stop a service as a whole (``Service.stop``), which also ends its
    ``$SRV`` discovery; an admission standby must stop answering checks and stay listed.
    The endpoint also leaves ``$SRV.INFO`` and ``$SRV.STATS``.
    """
    found = False
    for endpoint in list(service._endpoints):
        if endpoint._name == name:
            found = True
            with contextlib.suppress(Exception):  # already unsubscribed (a connection closing)
                await endpoint._stop()
            service._endpoints.remove(endpoint)
    return found
