"""Tests for protocols.transport: InProcessTransport with and without the wire path."""

import threading

import pytest

from cadence.protocols.codec import Codec, encode
from cadence.protocols.errors import ProtocolError
from cadence.protocols.messages import Control, EngineTimings, RolloutGroup, WeightsPublished
from cadence.protocols.transport import (
    BytesTransport,
    InProcessTransport,
    Transport,
    TransportClosed,
    TransportFull,
)

JOIN_SECONDS = 10.0  # generous upper bound for a thread that should finish almost at once


def make_group(prompt_id: str = "p-0") -> RolloutGroup:
    timings = EngineTimings(
        queued_at=1.0, started_at=2.0, finished_at=3.0, generate_seconds=1.0, num_tokens=3,
        engine="jax",
    )
    return RolloutGroup(
        prompt_id=prompt_id, task="sort", prompt_tokens=[4, 5],
        completion_tokens=[[1, 2], [3]], behavior_logprobs=[[-0.5, -0.25], [-1.0]],
        rewards=[1.0, 0.0], policy_version=7, actor_id="actor-1", timings=timings,
        exact_match=[True, False],
    )


EXAMPLES = [
    make_group(),
    WeightsPublished(version=8, step=80, location="inproc", published_at=5.0),
    Control(concurrency=4, stop=True),
]


def run_in_thread(fn):
    """Starts fn in a thread; returns (thread, outcome) where outcome gets 'result' or 'error'."""
    outcome = {}

    def target():
        try:
            outcome["result"] = fn()
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def test_implements_both_protocols():
    transport = InProcessTransport()
    assert isinstance(transport, Transport)
    assert isinstance(transport, BytesTransport)


def test_without_codec_items_pass_through_unchanged_in_order():
    transport = InProcessTransport()
    for msg in EXAMPLES:
        transport.put(msg)
    assert transport.qsize() == len(EXAMPLES)
    got = [transport.get(timeout=0) for _ in EXAMPLES]
    assert all(a is b for a, b in zip(got, EXAMPLES))


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_with_codec_every_message_goes_through_the_wire_bytes(msg):
    transport = InProcessTransport(codec=Codec())
    transport.put(msg)
    back = transport.get(timeout=0)
    assert back == msg and back is not msg
    transport.put(msg)
    assert transport.get_bytes(timeout=0) == encode(msg)  # the queue holds exactly wire bytes


def test_bytes_view_passes_bytes_and_feeds_the_decoding_get():
    transport = InProcessTransport(codec=Codec())
    transport.put_bytes(bytearray(encode(EXAMPLES[1])))
    assert transport.get(timeout=0) == EXAMPLES[1]
    with pytest.raises(TypeError, match="put_bytes expects bytes, got str"):
        transport.put_bytes("not bytes")


def test_get_bytes_refuses_an_object_put_without_codec():
    transport = InProcessTransport()
    transport.put(EXAMPLES[2])
    with pytest.raises(TypeError, match="get_bytes found a Control"):
        transport.get_bytes(timeout=0)


def test_bad_bytes_raise_from_get_and_the_next_item_still_arrives():
    transport = InProcessTransport(codec=Codec())
    transport.put_bytes(b"\x93\xa7cad")
    transport.put(EXAMPLES[2])
    with pytest.raises(ProtocolError, match="truncated message"):
        transport.get(timeout=0)
    assert transport.get(timeout=0) == EXAMPLES[2]


def test_put_none_is_refused():
    with pytest.raises(ValueError, match="cannot put None"):
        InProcessTransport().put(None)


def test_get_times_out_with_none():
    transport = InProcessTransport()
    assert transport.get(timeout=0) is None
    assert transport.get(timeout=0.01) is None
    assert transport.get_bytes(timeout=0.01) is None


def test_negative_timeout_and_maxsize_are_refused():
    with pytest.raises(ValueError, match="timeout: must be >= 0 or None, got -1"):
        InProcessTransport().get(timeout=-1)
    with pytest.raises(ValueError, match="maxsize: must be >= 0, got -1"):
        InProcessTransport(maxsize=-1)


def test_after_close_get_returns_none_and_put_raises():
    transport = InProcessTransport(codec=Codec())
    transport.put(EXAMPLES[0])
    transport.close()
    transport.close()  # idempotent
    assert transport.closed
    assert transport.get() is None  # no timeout, yet returns at once: queued items are dropped
    assert transport.get_bytes() is None
    assert transport.qsize() == 0
    with pytest.raises(TransportClosed):
        transport.put(EXAMPLES[0])
    with pytest.raises(TransportClosed):
        transport.put_bytes(b"x")


def test_close_wakes_a_blocked_get():
    transport = InProcessTransport()
    thread, outcome = run_in_thread(lambda: transport.get(timeout=None))
    transport.close()
    thread.join(JOIN_SECONDS)
    assert not thread.is_alive()
    assert outcome == {"result": None}


def test_close_wakes_a_blocked_put():
    transport = InProcessTransport(maxsize=1)
    transport.put(EXAMPLES[2])
    thread, outcome = run_in_thread(lambda: transport.put(EXAMPLES[1], timeout=None))
    transport.close()
    thread.join(JOIN_SECONDS)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), TransportClosed)


@pytest.mark.parametrize("codec", [None, Codec()], ids=["objects", "wire"])
def test_put_and_get_across_threads_keep_order(codec):
    transport = InProcessTransport(maxsize=4, codec=codec)  # small bound: producer must wait
    sent = [make_group(f"p-{i}") for i in range(100)]

    def produce():
        for msg in sent:
            transport.put(msg, timeout=JOIN_SECONDS)

    producer, outcome = run_in_thread(produce)
    received = [transport.get(timeout=JOIN_SECONDS) for _ in sent]
    producer.join(JOIN_SECONDS)
    assert outcome == {"result": None}
    assert [m.prompt_id for m in received] == [m.prompt_id for m in sent]
    assert received == sent


def test_many_producers_one_consumer_lose_nothing():
    transport = InProcessTransport(maxsize=3)
    threads = [
        run_in_thread(lambda a=a: [transport.put((a, i)) for i in range(50)])[0] for a in range(4)
    ]
    received = [transport.get(timeout=JOIN_SECONDS) for _ in range(200)]
    for thread in threads:
        thread.join(JOIN_SECONDS)
    assert sorted(received) == sorted((a, i) for a in range(4) for i in range(50))
    for a in range(4):  # each producer's items stay in its own order
        assert [i for b, i in received if b == a] == list(range(50))


def test_full_transport_times_out_with_a_clear_error():
    transport = InProcessTransport(maxsize=2)
    transport.put(EXAMPLES[0])
    transport.put(EXAMPLES[1])
    for timeout in (0, 0.01):
        with pytest.raises(TransportFull, match=r"transport full \(maxsize=2\)"):
            transport.put(EXAMPLES[2], timeout=timeout)
    assert transport.qsize() == 2
    assert transport.get(timeout=0) is EXAMPLES[0]
    transport.put(EXAMPLES[2], timeout=0)  # room again
    assert [transport.get(timeout=0) for _ in range(2)] == [EXAMPLES[1], EXAMPLES[2]]


def test_full_transport_blocks_put_until_a_get_makes_room():
    transport = InProcessTransport(maxsize=1)
    transport.put(EXAMPLES[0])
    done = threading.Event()

    def blocked_put():
        transport.put(EXAMPLES[1])
        done.set()

    thread, outcome = run_in_thread(blocked_put)
    assert not done.wait(0.05)  # backpressure: still waiting while the queue is full
    assert transport.get(timeout=0) is EXAMPLES[0]
    assert done.wait(JOIN_SECONDS)
    thread.join(JOIN_SECONDS)
    assert outcome == {"result": None}
    assert transport.get(timeout=0) is EXAMPLES[1]
