"""Groups per second from an actor process to the learner over ZeroMQ, vs raw pyzmq of the same bytes.

Three ways of moving the same RolloutGroups from a sender process to this process over tcp on
127.0.0.1, each timed from the first message received to the last:
  raw        bare pyzmq PUSH/PULL of pre-encoded bytes (no encode, no decode): poll, then recv
  raw_best   the same, received the fastest bare way: recv(NOBLOCK) first, poll only when nothing
             waits, big messages uncopied (ZmqTransport receives so; a stricter bound than raw)
  transport  protocols.zmq_transport.ZmqTransport with the codec: the sender encodes each group,
             the receiver decodes and validates it
  dispatch   the dispatcher protocol as actors use it: DispatcherClient.send_groups (I/O thread,
             DEALER) -> DispatchServer (ROUTER, decode, grant check, ledger) -> the learner's queue
Each way runs `--rounds` times, the four alternating, and its median groups/s is reported (one run
of 4000 small groups lasts ~50 ms: a single run's ratio swung 0.2-0.8 with the machine's noise).
Prints one JSON line per group shape with the medians, the ratios of the medians to raw (goal
>= 0.8) with the transport's per-round range, and the transport's ratio to raw_best.

    python benchmarks/zmq_bench.py [--groups 20000] [--rounds 5] [--seconds-cap 60]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = ((8, 8), (16, 1024))


def _send_raw(endpoint, payload, n):
    import zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 1000)
    s.connect(endpoint)
    for _ in range(n):
        s.send(payload, copy=len(payload) < 65536)
    s.close(linger=-1)
    ctx.term()


def _send_transport(endpoint, shape, n):
    from codec_bench import make_group
    from protocols.codec import Codec
    from protocols.zmq_transport import ZmqTransport
    group, codec = make_group(*shape), Codec()
    t = ZmqTransport(endpoint, "push", bind=False)
    for _ in range(n):
        t.put_bytes(codec.encode(group))
    t._sock.close(linger=-1)
    import zmq
    zmq.Context.instance().term()  # blocks until the queued messages are out: exiting first loses them


def _send_dispatch(endpoint, shape, n):
    import zmq
    from codec_bench import make_group
    from protocols.dispatch_client import DispatcherClient
    ctx = zmq.Context()
    c = DispatcherClient(endpoint, "bench", n, ctx=ctx).start()
    c.wait_welcome(30)
    stop = threading.Event()
    grant = c.request(n, stop, timeout=30)
    base = make_group(*shape)
    fields = {f: getattr(base, f) for f in base.__struct_fields__}
    from protocols.messages import RolloutGroup
    groups = [RolloutGroup(**{**fields, "prompt_id": pid, "grant_id": grant.grant_id, "policy_version": 0})
              for pid in grant.prompt_ids]
    for g in groups:
        c.send_groups([g], grant)
    while c._out:  # the I/O thread drains what was queued
        time.sleep(0.01)
    time.sleep(0.5)
    c.close()


def _receive(get, n, cap):
    got, t_first = 0, None
    deadline = time.monotonic() + cap
    while got < n and time.monotonic() < deadline:
        if get() is not None:
            got += 1
            if t_first is None:
                t_first = time.perf_counter()
    return got, (time.perf_counter() - t_first) if t_first else float("inf")


def bench_raw(payload, n, cap, best=False):
    """best=False: poll, then recv (the plain blocking-with-timeout loop). best=True: the fastest
    bare loop we know: recv(NOBLOCK) first and poll only when nothing waits, big messages uncopied."""
    import zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    p = mp.get_context("spawn").Process(target=_send_raw, args=(f"tcp://127.0.0.1:{port}", payload, n))
    p.start()
    copy = len(payload) < 65536

    def get_best():
        try:
            return s.recv(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return s.recv(copy=copy) if s.poll(100) else None

    got, secs = _receive(get_best if best else (lambda: s.recv() if s.poll(100) else None), n, cap)
    p.join()
    s.close(0)
    ctx.term()
    return got / secs


def bench_transport(shape, n, cap):
    from protocols.codec import Codec
    from protocols.zmq_transport import ZmqTransport
    codec = Codec()
    t = ZmqTransport("tcp://127.0.0.1:0", "pull", bind=True)
    p = mp.get_context("spawn").Process(target=_send_transport, args=(t.endpoint, shape, n))
    p.start()

    def get():
        data = t.get_bytes(timeout=0.1)
        return None if data is None else codec.decode(data)

    got, secs = _receive(get, n, cap)
    p.join()
    t.close()
    return got / secs


def bench_dispatch(shape, n, cap):
    import zmq
    from actors.prompt_stream import PromptStream
    from actors.tasks.registry import make_task
    from actors.tasks.config import TaskConfig
    from protocols.admission import AdmissionGate
    from protocols.dispatch import Dispatcher, DispatchSettings
    from protocols.dispatch_server import DispatchServer
    from protocols.ledger import SampleLedger
    from protocols.transport import InProcessTransport
    G = shape[0]
    queue = InProcessTransport()
    stream = PromptStream(make_task(TaskConfig(name="sort", num_digits=6, heldout_size=4)))
    core = Dispatcher(stream, SampleLedger(), AdmissionGate(G * n, 0), DispatchSettings(group_size=G),
                      deliver=queue.put, version_fn=lambda: 0)
    ctx = zmq.Context()
    server = DispatchServer(core, ctx=ctx, external="tcp://127.0.0.1:0").start()
    p = mp.get_context("spawn").Process(target=_send_dispatch, args=(server.endpoint, shape, n))
    p.start()
    got, secs = _receive(lambda: queue.get(timeout=0.1), n, cap)
    p.join()
    server.stop()
    ctx.destroy(linger=0)
    return got / secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=20000, help="groups per measurement (small shape)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the four ways, alternating; medians")
    ap.add_argument("--seconds-cap", type=float, default=60.0)
    a = ap.parse_args()
    from codec_bench import make_group
    from protocols.codec import encode
    for shape in SHAPES:
        n = a.groups if shape[1] < 100 else max(a.groups // 10, 200)
        payload = encode(make_group(*shape))
        ways = {"raw": lambda: bench_raw(payload, n, a.seconds_cap),
                "raw_best": lambda: bench_raw(payload, n, a.seconds_cap, best=True),
                "transport": lambda: bench_transport(shape, n, a.seconds_cap),
                "dispatch": lambda: bench_dispatch(shape, n, a.seconds_cap)}
        rates = {way: [] for way in ways}
        for _ in range(a.rounds):  # alternating, so a noisy moment hits every way alike
            for way, run in ways.items():
                rates[way].append(run())
        med = {way: statistics.median(r) for way, r in rates.items()}
        per_round = [t / r for t, r in zip(rates["transport"], rates["raw"])]
        print(json.dumps({"bench": "zmq_groups", "group": f"{shape[0]}x{shape[1]}", "bytes": len(payload),
                          "groups": n, "rounds": a.rounds,
                          **{f"{way}_groups_per_second": round(m, 1) for way, m in med.items()},
                          "transport_ratio": round(med["transport"] / med["raw"], 3),
                          "transport_ratio_range": [round(min(per_round), 3), round(max(per_round), 3)],
                          "dispatch_ratio": round(med["dispatch"] / med["raw"], 3),
                          "transport_ratio_to_best": round(med["transport"] / med["raw_best"], 3)}),
              flush=True)


if __name__ == "__main__":
    main()
