"""Weight publication to actor processes: seconds until 2 actors hold a new version, vs raw ZeroMQ.

Ours: the learner's params (a JAX tree of the Llama) published to a WeightServer; two actor
processes (RemoteWeights, as `cadence actor` runs it) each ask for the newest version, receive the
frames and rebuild their JAX parameter tree. Baseline, same run: a bare ROUTER that answers each
request with the same arrays' bytes as frames, to two bare DEALER processes that only receive.
Timed per round from the publication until both actors hold it as JAX arrays (`seconds`), and until
both hold the bytes (`transfer_seconds`: the part the bare baseline does; building JAX arrays is
one more copy, which the baseline never makes). Both setups stay up and their rounds alternate, so
a noisy moment of the shared machine hits both; medians over the rounds after the first. Prints
one JSON line per model size with the ratios raw / ours (goal >= 0.8).

    python benchmarks/weights_bench.py [--sizes 1m 25m] [--rounds 9]
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
    from cadence.learner.models.config import ModelConfig
    from cadence.learner.models.llama import init_params
    cfg = dataclasses.replace(ModelConfig(), **SIZES[size])
    return init_params(cfg, 0)


def _ours(endpoint, size, rounds, ready, go, done):
    """What RemoteWeights.ensure does, timed in its two halves: bytes in, JAX arrays built."""
    import jax
    import zmq
    from cadence.learner.models.named_arrays import ParamLayout
    from cadence.protocols.weights_wire import WeightClient
    _, template = model(size)
    layout = ParamLayout(template)
    client = WeightClient(endpoint, ctx=zmq.Context())
    have = -1
    ready.put(1)
    for v in range(1, rounds + 1):
        assert go.get() == v  # as a grant tells a real actor: version v exists
        have, named = client.fetch(have)
        received = time.time()
        jax.block_until_ready(jax.tree.leaves(layout.build(named)))
        done.put((v, received, time.time()))


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
        done.put(time.time())


def _spawn(target, args, actors):
    """`actors` processes running target(*args, ready, go, done), each told when to go by its own
    queue; returns once all are ready: (processes, go queues, the shared done queue)."""
    spawn = mp.get_context("spawn")
    ready, done, gos = spawn.Queue(), spawn.Queue(), [spawn.Queue() for _ in range(actors)]
    procs = [spawn.Process(target=target, args=(*args, ready, go, done)) for go in gos]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    return procs, gos, done


class Ours:
    """A WeightServer publishing the learner's tree, and `actors` processes fetching and building it."""

    def __init__(self, size, rounds, actors=2):
        import zmq
        from cadence.learner.models.named_arrays import ParamLayout
        from cadence.protocols.weights_wire import WeightServer
        _, self.params = model(size)
        self.layout = ParamLayout(self.params)
        self.ctx = zmq.Context()
        self.server = WeightServer("tcp://127.0.0.1:0", ctx=self.ctx).start()
        self.procs, self.gos, self.done = _spawn(_ours, (self.server.endpoint, size, rounds), actors)
        self.nbytes = sum(a.nbytes for _, a in self.layout.named(self.params))

    def round(self, v):
        """(seconds until every actor holds version v as JAX arrays, seconds until it holds the bytes)"""
        import jax
        params = jax.tree.map(lambda x: x + 0, self.params)  # a new version's arrays, as a train step makes them
        jax.block_until_ready(jax.tree.leaves(params))
        t0 = time.time()
        self.server.publish(v, lambda p=params: self.layout.named(p))
        for go in self.gos:
            go.put(v)
        got = [self.done.get(timeout=300) for _ in self.procs]
        assert all(g[0] == v for g in got)
        return max(g[2] for g in got) - t0, max(g[1] for g in got) - t0

    def close(self):
        for p in self.procs:
            p.join()
        self.server.stop()
        self.ctx.destroy(linger=0)


class Raw:
    """A bare ROUTER answering `actors` bare DEALER processes with the same arrays' bytes as frames."""

    def __init__(self, size, rounds, actors=2):
        import zmq
        from cadence.learner.models.named_arrays import named_arrays
        _, params = model(size)
        self.frames = [a.tobytes() for _, a in named_arrays(params)]
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.procs, self.gos, self.done = _spawn(_raw, (f"tcp://127.0.0.1:{port}", rounds), actors)

    def round(self, v):
        t0 = time.time()
        for go in self.gos:
            go.put(v)
        for _ in self.procs:
            peer, _ = self.sock.recv_multipart()
            self.sock.send_multipart([peer, *self.frames], copy=False)
        return max(self.done.get(timeout=300) for _ in self.procs) - t0

    def close(self):
        for p in self.procs:
            p.join()
        self.sock.close(0)
        self.ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    for size in a.sizes:
        ours, raw = Ours(size, a.rounds), Raw(size, a.rounds)
        times, transfers, raws = [], [], []
        for v in range(1, a.rounds + 1):  # alternating, so a noisy moment hits both alike
            seconds, transfer = ours.round(v)
            times.append(seconds)
            transfers.append(transfer)
            raws.append(raw.round(v))
        ours.close()
        raw.close()
        med = {k: statistics.median(x[1:]) for k, x in (("ours", times), ("transfer", transfers), ("raw", raws))}
        print(json.dumps({"bench": "weights_to_actor_processes", "model": size, "actors": 2, "rounds": a.rounds,
                          "params": ours.nbytes // 4, "bytes": ours.nbytes, "seconds": round(med["ours"], 4),
                          "transfer_seconds": round(med["transfer"], 4), "raw_seconds": round(med["raw"], 4),
                          "ratio": round(med["raw"] / med["ours"], 3),
                          "transfer_ratio": round(med["raw"] / med["transfer"], 3)}), flush=True)


if __name__ == "__main__":
    main()
