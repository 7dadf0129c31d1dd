"""Tests for protocols.receiver: bad messages are counted and skipped, good ones delivered."""

import logging
import threading

import msgspec
import pytest

from cadence.protocols.codec import Codec, encode
from cadence.protocols.messages import Control, WeightsPublished
from cadence.protocols.receiver import Receiver
from cadence.protocols.transport import InProcessTransport

JOIN_SECONDS = 10.0

GOOD = [
    WeightsPublished(version=1, step=10, location="inproc", published_at=1.0),
    Control(concurrency=64),
]
TRUNCATED = encode(GOOD[0])[:-2]
WRONG_VERSION = msgspec.msgpack.encode(["cadence", 99, {"type": "control"}])


def test_bad_good_bad_good_delivers_both_good_and_counts_two_errors(caplog):
    transport = InProcessTransport()
    for data in (TRUNCATED, encode(GOOD[0]), WRONG_VERSION, encode(GOOD[1])):
        transport.put_bytes(data)
    receiver = Receiver(transport, Codec())
    with caplog.at_level(logging.WARNING, logger="cadence.protocols.receiver"):
        got = [receiver.receive(timeout=0), receiver.receive(timeout=0)]
    assert got == GOOD
    assert receiver.received_count == 2
    assert receiver.error_count == 2
    assert dict(receiver.errors_by_kind) == {"MalformedMessage": 1, "SchemaVersionMismatch": 1}
    assert receiver.last_error == (
        "schema version mismatch: message has version 99, this codec speaks version 2"
    )
    assert "truncated message" in caplog.text and "skipped a bad message" in caplog.text
    assert receiver.receive(timeout=0) is None  # nothing left


def test_receive_of_only_bad_messages_times_out_with_none():
    transport = InProcessTransport()
    for _ in range(3):
        transport.put_bytes(b"\xc1")  # 0xc1 is never used in MessagePack
    receiver = Receiver(transport)
    assert receiver.receive(timeout=0.01) is None
    assert receiver.error_count == 3
    assert receiver.received_count == 0
    assert receiver.last_error.startswith("malformed message")


def test_receive_returns_none_once_the_transport_is_closed():
    transport = InProcessTransport()
    transport.close()
    assert Receiver(transport).receive(timeout=None) is None


def test_background_thread_delivers_messages_until_stopped():
    transport = InProcessTransport(codec=Codec())
    delivered = []
    all_arrived = threading.Event()

    def on_message(msg):
        delivered.append(msg)
        if len(delivered) == 2:
            all_arrived.set()

    receiver = Receiver(transport, on_message=on_message, poll_seconds=0.01)
    receiver.start()
    transport.put(GOOD[0])
    transport.put_bytes(b"not a message")
    transport.put(GOOD[1])
    assert all_arrived.wait(JOIN_SECONDS)
    receiver.stop(JOIN_SECONDS)
    assert delivered == GOOD
    assert receiver.error_count == 1


def test_run_returns_when_the_transport_closes():
    transport = InProcessTransport()
    receiver = Receiver(transport, on_message=lambda msg: None, poll_seconds=0.01)
    thread = threading.Thread(target=receiver.run, daemon=True)
    thread.start()
    transport.close()
    thread.join(JOIN_SECONDS)
    assert not thread.is_alive()


def test_a_failing_consumer_is_not_hidden():
    transport = InProcessTransport()
    called = threading.Event()

    def on_message(msg):
        called.set()
        raise KeyError("consumer bug")

    receiver = Receiver(transport, on_message=on_message, poll_seconds=0.01)
    receiver.start()
    transport.put_bytes(encode(GOOD[1]))
    assert called.wait(JOIN_SECONDS)
    with pytest.raises(KeyError, match="consumer bug"):
        receiver.stop(JOIN_SECONDS)  # joins the thread, then re-raises what ended it
    receiver.stop()  # raised once; a second stop is quiet


def test_run_and_start_need_on_message():
    receiver = Receiver(InProcessTransport())
    with pytest.raises(ValueError, match="on_message: required"):
        receiver.run()
    with pytest.raises(ValueError, match="on_message: required"):
        receiver.start()
