import pytest
import zmq

from cadence.protocols.zmq_transport import stop_authenticator


@pytest.fixture
def ctx():
    """A ZeroMQ context of the test's own, its Curve authenticator (if any) stopped at the end."""
    c = zmq.Context()
    yield c
    stop_authenticator(c)
    c.destroy(linger=0)
