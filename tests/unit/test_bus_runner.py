"""``bus.runner.jetstream_unavailable``: which start-up failures are worth building the
service again for (JetStream not answering), and which end the process at once."""

from __future__ import annotations

import nats.errors
import nats.js.errors

from bus.runner import jetstream_unavailable
from proto import MeshError


def test_jetstream_not_answering_is_retried() -> None:
    assert jetstream_unavailable(nats.errors.TimeoutError())  # "nats: timeout": an election
    assert jetstream_unavailable(nats.errors.NoRespondersError())
    assert jetstream_unavailable(nats.js.errors.ServiceUnavailableError())
    assert jetstream_unavailable(nats.js.errors.APIError(code=503, err_code=10008, description="JetStream system temporarily unavailable"))
    try:  # wrapped by the service
        try:
            raise nats.errors.TimeoutError
        except nats.errors.TimeoutError as inner:
            raise MeshError("could not open the bucket") from inner
    except MeshError as outer:
        assert jetstream_unavailable(outer)


def test_other_failures_are_not() -> None:
    assert not jetstream_unavailable(ValueError("bad config"))
    assert not jetstream_unavailable(nats.js.errors.APIError(code=400, err_code=10058, description="stream name in use"))
    assert not jetstream_unavailable(OSError("address in use"))
