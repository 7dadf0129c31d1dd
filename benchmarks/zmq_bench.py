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

`--auth` instead measures what authenticating actor processes costs (issue 31): the dispatch way
with 16x1024 groups, and a weights fetch (WeightServer -> WeightClient in another process, 64 MB
in 16 MB frames), each over
  tcp        tcp://127.0.0.1, unauthenticated: what every run listened on before (the baseline)
  tcp_curve  the same with CurveZMQ keys (every byte encrypted and authenticated)
  ipc        ipc:// in a 0700 directory, the peer's uid checked (the default now)
rounds alternating, medians; one JSON line with each setup's rate and its ratio to tcp.

    python benchmarks/zmq_bench.py [--groups 20000] [--rounds 5] [--seconds-cap 60]
    python benchmarks/zmq_bench.py --auth [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import os
import shutil
import statistics
import sys
import tempfile
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
    from cadence.protocols.codec import Codec
    from cadence.protocols.zmq_transport import ZmqTransport
    group, codec = make_group(*shape), Codec()
    t = ZmqTransport(endpoint, "push", bind=False)
    for _ in range(n):
        t.put_bytes(codec.encode(group))
    t._sock.close(linger=-1)
    import zmq
    zmq.Context.instance().term()  # blocks until the queued messages are out: exiting first loses them


def _send_dispatch(endpoint, shape, n, keys_dir=""):
    import zmq
    from codec_bench import make_group
    from cadence.protocols.dispatch_client import DispatcherClient
    from cadence.protocols.zmq_transport import CurveKeys
    ctx = zmq.Context()
    keys = CurveKeys.load(keys_dir) if keys_dir else None
    c = DispatcherClient(endpoint, "bench", n, ctx=ctx, keys=keys).start()
    c.wait_welcome(30)
    stop = threading.Event()
    grant = c.request(n, stop, timeout=30)
    base = make_group(*shape)
    fields = {f: getattr(base, f) for f in base.__struct_fields__}
    from cadence.protocols.messages import RolloutGroup
    task = _bench_task()
    groups = [RolloutGroup(**{**fields, "prompt_id": pid, "grant_id": grant.grant_id, "policy_version": 0,
                              "prompt_tokens": list(task.prompt(i).tokens)})  # the granted prompt's
              for pid, i in zip(grant.prompt_ids, grant.prompt_indices)]
    for g in groups:
        c.send_groups([g], grant)
    while c._out:  # the I/O thread drains what was queued
        time.sleep(0.01)
    time.sleep(0.5)
    c.close()


def _bench_task():
    from cadence.actors.tasks.config import TaskConfig
    from cadence.actors.tasks.registry import make_task
    return make_task(TaskConfig(name="sort", num_digits=6, heldout_size=4))


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
    from cadence.protocols.codec import Codec
    from cadence.protocols.zmq_transport import ZmqTransport
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


def _listen(scheme: str, workdir: str):
    """(endpoint to bind, keys or None, keys_dir for the peer) for one --auth setup."""
    from cadence.protocols.zmq_transport import private_dir, write_keys
    if scheme == "tcp":
        return "tcp://127.0.0.1:0", None, ""
    if scheme == "tcp_curve":
        keys_dir = os.path.join(workdir, "keys")
        return "tcp://127.0.0.1:0", write_keys(keys_dir), keys_dir
    return f"ipc://{private_dir(workdir)}/dispatch", None, ""


def bench_dispatch(shape, n, cap, scheme="tcp"):
    import zmq
    from cadence.actors.prompt_stream import PromptStream
    from cadence.protocols.admission import AdmissionGate
    from cadence.protocols.dispatch import Dispatcher, DispatchSettings
    from cadence.protocols.dispatch_server import DispatchServer
    from cadence.protocols.ledger import SampleLedger
    from cadence.protocols.transport import InProcessTransport
    from cadence.protocols.zmq_transport import stop_authenticator
    G = shape[0]
    queue = InProcessTransport()
    stream = PromptStream(_bench_task())
    core = Dispatcher(stream, SampleLedger(), AdmissionGate(G * n, 0), DispatchSettings(group_size=G),
                      deliver=queue.put, version_fn=lambda: 0)
    ctx = zmq.Context()
    workdir = tempfile.mkdtemp(prefix="zmq-bench-")
    endpoint, keys, keys_dir = _listen(scheme, workdir)
    server = DispatchServer(core, ctx=ctx, external=endpoint, keys=keys).start()
    p = mp.get_context("spawn").Process(target=_send_dispatch, args=(server.endpoint, shape, n, keys_dir))
    p.start()
    got, secs = _receive(lambda: queue.get(timeout=0.1), n, cap)
    p.join()
    server.stop()
    stop_authenticator(ctx)
    ctx.destroy(linger=0)
    shutil.rmtree(workdir, ignore_errors=True)
    return got / secs


WEIGHT_ARRAYS, WEIGHT_MB = 4, 16  # 64 MB in frames of 16 MB (WeightServer's chunk)


def _fetch_weights(endpoint, keys_dir, rounds, out):
    import zmq
    from cadence.protocols.weights_wire import WeightClient
    from cadence.protocols.zmq_transport import CurveKeys
    client = WeightClient(endpoint, ctx=zmq.Context(), keys=CurveKeys.load(keys_dir) if keys_dir else None)
    client.fetch(-1)  # connected and warm
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        client.fetch(-1)
        seconds.append(time.perf_counter() - t0)
    out.put(statistics.median(seconds))


def bench_weights(scheme, rounds=3):
    """MB/s of one weights fetch by an actor process (median of `rounds` fetches)."""
    import numpy as np
    import zmq
    from cadence.protocols.weights_wire import WeightServer
    from cadence.protocols.zmq_transport import stop_authenticator
    ctx = zmq.Context()
    workdir = tempfile.mkdtemp(prefix="zmq-bench-")
    endpoint, keys, keys_dir = _listen(scheme, workdir)
    server = WeightServer(endpoint.replace("/dispatch", "/weights"), ctx=ctx, keys=keys).start()
    arrays = [(f"w{i}", np.full(WEIGHT_MB << 18, i, np.float32)) for i in range(WEIGHT_ARRAYS)]
    server.publish(1, lambda: arrays)
    out = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_fetch_weights, args=(server.endpoint, keys_dir, rounds, out))
    p.start()
    seconds = out.get(timeout=300)
    p.join()
    server.stop()
    stop_authenticator(ctx)
    ctx.destroy(linger=0)
    shutil.rmtree(workdir, ignore_errors=True)
    return WEIGHT_ARRAYS * WEIGHT_MB / seconds


def main_auth(a) -> None:
    shape, n = (16, 1024), max(a.groups // 10, 200)
    schemes = ("tcp", "tcp_curve", "ipc")
    groups = {s: [] for s in schemes}
    weights = {s: [] for s in schemes}
    for _ in range(a.rounds):  # alternating, so a noisy moment hits every setup alike
        for s in schemes:
            groups[s].append(bench_dispatch(shape, n, a.seconds_cap, s))
            weights[s].append(bench_weights(s))
    g = {s: statistics.median(v) for s, v in groups.items()}
    w = {s: statistics.median(v) for s, v in weights.items()}
    cheaper = min(("tcp_curve", "ipc"), key=lambda s: -(g[s] / g["tcp"] + w[s] / w["tcp"]))
    print(json.dumps({"bench": "zmq_auth", "group": f"{shape[0]}x{shape[1]}", "groups": n, "rounds": a.rounds,
                      "weights_mb": WEIGHT_ARRAYS * WEIGHT_MB,
                      "dispatch_groups_per_second": {s: round(v, 1) for s, v in g.items()},
                      "dispatch_ratio_to_tcp": {s: round(v / g["tcp"], 3) for s, v in g.items()},
                      "weights_mb_per_second": {s: round(v, 1) for s, v in w.items()},
                      "weights_ratio_to_tcp": {s: round(v / w["tcp"], 3) for s, v in w.items()},
                      "cheaper_authenticated": cheaper}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=20000, help="groups per measurement (small shape)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the four ways, alternating; medians")
    ap.add_argument("--seconds-cap", type=float, default=60.0)
    ap.add_argument("--auth", action="store_true", help="compare tcp, tcp with Curve keys and ipc instead")
    a = ap.parse_args()
    if a.auth:
        return main_auth(a)
    from codec_bench import make_group
    from cadence.protocols.codec import encode
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
