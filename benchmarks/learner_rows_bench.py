"""Bytes each learner process receives per update: a whole-batch broadcast (the protocol before
rows were cut per process) vs each process's own rows (learner/leader.py), same run.

Starts two real learner processes (jax.distributed over loopback, one CPU device each, the
default fsdp mesh over both, as `cadence train learner.processes=2` runs them). Process 0 first
broadcasts one batch whole through the command channel (what every update used to cost each
follower), then runs --updates updates whose rows it cuts per process. The follower counts what
its channel received (Channel.received_bytes: broadcasts and its part, padding included).
Prints one JSON line. Run: `.venv/bin/python benchmarks/learner_rows_bench.py [--batch 512]`.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _groups(n: int, group_size: int, seq_len: int, seed: int):
    import numpy as np

    from cadence.protocols.testing import rollout_group

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        comps = [[int(x) for x in rng.integers(3, 32, rng.integers(seq_len // 4, seq_len - 8))]
                 for _ in range(group_size)]
        out.append(rollout_group(f"g{i}", "t", [1, 4, 5, 6], comps, [[-float(rng.exponential()) for _ in c] for c in comps],
                                 [float(x) for x in rng.random(group_size)], 0))
    return out


def _process(out_dir: str, batch: int, microbatch: int, seq_len: int, updates: int) -> None:
    import jax

    from cadence.learner import sharding
    from cadence.learner.batching import build_microbatches
    from cadence.learner.config import DistributedConfig, LearnerConfig, MeshConfig
    from cadence.learner.leader import Follower, Leader
    from cadence.learner.models import llama
    from cadence.learner.models.config import ModelConfig
    from cadence.learner.multihost import join, microbatch_arrays
    from cadence.learner.steps import make_train_step

    group = join(DistributedConfig())
    model = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=seq_len)
    cfg = LearnerConfig(batch_size=batch, microbatch_size=microbatch, group_size=8, mesh=MeshConfig())
    _, abstract = llama.abstract_params(model)
    layout = sharding.make_layout(cfg.mesh, abstract)
    graphdef, params = llama.init_params(model, 0, layout.params)
    step = make_train_step(graphdef, cfg, layout)
    result = {"process": group.process_id}
    if not group.is_leader:
        follower = Follower(group, layout, step, params, None, lambda s: {}, calls={"whole": lambda meta, p: None})
        follower.run()
        result.update(whole_broadcast_bytes=follower.received_bytes["call"],
                      update_bytes=follower.received_bytes["update"], updates=int(follower.state.step))
    else:
        lead = Leader(group, layout, params)
        leader_step = lead.wrap_step(step)
        state = leader_step.init(params)
        batches = [build_microbatches(_groups(batch // 8, 8, seq_len, k), seq_len, microbatch, 0, cfg.grpo)
                   for k in range(updates)]
        with lead.lock:  # one batch whole to every process, as each update used to send it
            lead.send("call", {"name": "whole", "num_tokens": 0, "gen": 0, "step": 0},
                      microbatch_arrays(batches[0][0]))
        t0 = time.perf_counter()
        for mbs, stats in batches:
            state, _ = leader_step.update(state, mbs, stats["num_tokens"])
        result.update(update_seconds=(time.perf_counter() - t0) / updates,
                      batch_array_bytes=sum(v.nbytes for v in microbatch_arrays(batches[0][0]).values()))
        lead.stop()
    with open(os.path.join(out_dir, f"result-{group.process_id}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--microbatch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--process", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.process:
        _process(args.process, args.batch, args.microbatch, args.seq_len, args.updates)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
               "CADENCE_COORDINATOR": f"127.0.0.1:{port}", "CADENCE_NUM_PROCESSES": "2"}
        argv = [sys.executable, __file__, "--process", tmp, "--batch", str(args.batch), "--microbatch",
                str(args.microbatch), "--seq-len", str(args.seq_len), "--updates", str(args.updates)]
        procs = [subprocess.Popen(argv, env={**env, "CADENCE_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for i in range(2)]
        outs = [p.communicate(timeout=1200)[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit("\n".join(o[-3000:] for o in outs))
        lead, follow = (json.loads(pathlib.Path(tmp, f"result-{i}.json").read_text()) for i in range(2))
    per_update = follow["update_bytes"] / follow["updates"]
    print(json.dumps({
        "bench": "learner_rows", "learner_processes": 2, "batch": args.batch, "microbatch": args.microbatch,
        "seq_len": args.seq_len, "batch_array_bytes": lead["batch_array_bytes"],
        "whole_batch_bytes_per_update": follow["whole_broadcast_bytes"],
        "own_rows_bytes_per_update": round(per_update),
        "ratio": round(per_update / follow["whole_broadcast_bytes"], 3),
        "update_seconds": round(lead["update_seconds"], 3),
    }))


if __name__ == "__main__":
    main()
