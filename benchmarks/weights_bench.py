"""Weight publication to actor processes: seconds until 2 actors hold a new version, vs raw ZeroMQ.

Ours: the learner's params (a JAX tree of the Llama) published to a WeightServer; two actor
processes (RemoteWeights, as `cadence actor` runs it) each ask for the newest version, receive the
frames and rebuild their JAX parameter tree. Baseline, same run: a bare ROUTER that answers each
request with the same arrays' bytes as frames, to two bare DEALER processes that only receive.
Timed per round from the publication until both actors hold it; median over rounds. Prints one JSON
line per model size with the ratio raw / ours (goal >= 0.8).

    python benchmarks/weights_bench.py [--sizes 1m 25m] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {  # ModelConfig overrides: ~1M and ~25M parameters
    "1m": {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "d_ff": 512,
           "vocab_size": 256},
    "25m": {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 8, "d_ff": 1536,
            "vocab_size": 256},
}


def model(size: str):
    import dataclasses
    from learner.models.config import ModelConfig
    from learner.models.llama import init_params
    cfg = dataclasses.replace(ModelConfig(), **SIZES[size])
    return init_params(cfg, 0)


def _ours(endpoint, size, rounds, ready, go, done):
    import zmq
    from actors.remote_weights import RemoteWeights
    from protocols.weights_wire import WeightClient
    _, template = model(size)
    ctx = zmq.Context()
    weights = RemoteWeights(lambda e: WeightClient(e, ctx=ctx), template, endpoint_fn=lambda: endpoint)
    ready.put(1)
    for v in range(1, rounds + 1):
        assert go.get() == v  # as a grant tells a real actor: version v exists
        weights.ensure(v)
        import jax
        jax.block_until_ready(jax.tree.leaves(weights.latest()[0]))
        done.put(v)


def _raw(endpoint, rounds, ready, go, done):
    import zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.MAXMSGSIZE, -1)
    s.connect(endpoint)
    ready.put(1)
    for v in range(1, rounds + 1):
        assert go.get() == v
        s.send(str(v).encode())
        s.recv_multipart(copy=False)
        done.put(v)


def bench_ours(size, rounds, actors=2):
    import zmq
    from learner.models.named_arrays import ParamLayout
    from protocols.weights_wire import WeightServer
    _, params = model(size)
    layout = ParamLayout(params)
    ctx = zmq.Context()
    server = WeightServer("tcp://127.0.0.1:0", ctx=ctx).start()
    spawn = mp.get_context("spawn")
    ready, done, gos = spawn.Queue(), spawn.Queue(), [spawn.Queue() for _ in range(actors)]
    procs = [spawn.Process(target=_ours, args=(server.endpoint, size, rounds, ready, go, done)) for go in gos]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    times = []
    for v in range(1, rounds + 1):
        import jax
        params = jax.tree.map(lambda x: x + 0, params)  # a new version's arrays, as a train step makes them
        jax.block_until_ready(jax.tree.leaves(params))
        t0 = time.perf_counter()
        server.publish(v, lambda p=params: layout.named(p))
        for go in gos:
            go.put(v)
        for _ in procs:
            assert done.get(timeout=300) == v
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join()
    nbytes = sum(a.nbytes for _, a in layout.named(params))
    server.stop()
    ctx.destroy(linger=0)
    return statistics.median(times[1:] or times), nbytes


def bench_raw(size, rounds, actors=2):
    import zmq
    from learner.models.named_arrays import named_arrays
    _, params = model(size)
    frames = [a.tobytes() for _, a in named_arrays(params)]
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    spawn = mp.get_context("spawn")
    ready, done, gos = spawn.Queue(), spawn.Queue(), [spawn.Queue() for _ in range(actors)]
    procs = [spawn.Process(target=_raw, args=(f"tcp://127.0.0.1:{port}", rounds, ready, go, done)) for go in gos]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    times = []
    for v in range(1, rounds + 1):
        t0 = time.perf_counter()
        for go in gos:
            go.put(v)
        for _ in procs:
            peer, _ = s.recv_multipart()
            s.send_multipart([peer, *frames], copy=False)
        for _ in procs:
            assert done.get(timeout=300) == v
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join()
    s.close(0)
    ctx.term()
    return statistics.median(times[1:] or times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    for size in a.sizes:
        ours, nbytes = bench_ours(size, a.rounds)
        raw = bench_raw(size, a.rounds)
        print(json.dumps({"bench": "weights_to_actor_processes", "model": size, "actors": 2,
                          "params": nbytes // 4, "bytes": nbytes, "seconds": round(ours, 4),
                          "raw_seconds": round(raw, 4), "ratio": round(raw / ours, 3)}), flush=True)


if __name__ == "__main__":
    main()
