"""The built-in engine decoding tensor-parallel on 4 CPU devices (run by engine_tp_test.py).

`python engine_tp_checks.py` prints one JSON line per check: tp 4 against the one-device
engine on the same params (greedy and sampled tokens, log-probs), what each device holds of the
params, whether the compiled decode loop carries the KV cache split by KV head, and a weight
publication through a real WeightServer / RemoteWeights built straight into the engine's shards.
"""
from __future__ import annotations

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402
import zmq  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from cadence.actors.engine import EngineConfig, JaxEngine  # noqa: E402
from cadence.actors.engine_mesh import device_bytes  # noqa: E402
from cadence.actors.remote_weights import RemoteWeights  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.models.named_arrays import named_arrays  # noqa: E402
from cadence.learner.sharding import tree_bytes  # noqa: E402
from cadence.protocols.weights_wire import WeightClient, WeightServer  # noqa: E402

# 8 query and 4 KV heads of width 8, an untied head and q/k/v biases: every kind of parameter.
MODEL = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128, max_seq_len=48,
                    tie_embeddings=False, qkv_bias=True)
NEW = 8
PROMPTS = [[1, 5, 9], [1], [1, 7, 3, 2, 8, 11, 4, 20, 30], [1, 12], [1, 40, 41, 42, 43]]
NO_EOS = MODEL.vocab_size


def engine(tp: int, graphdef) -> JaxEngine:
    return JaxEngine(MODEL, graphdef, EngineConfig(max_new_tokens=NEW, batch_buckets=(8,), tensor_parallel=tp),
                     eos_id=NO_EOS, pad_id=0)


def compare(a, b) -> dict:
    same_lengths = bool(np.array_equal(a.lengths, b.lengths))
    return {"same_tokens": bool(np.array_equal(a.tokens, b.tokens)) and same_lengths,
            "max_logprob_diff": float(np.max(np.abs(a.logprobs - b.logprobs)))}


def main() -> None:
    graphdef, params = llama.init_params(MODEL, 0)
    embedding = params["embed_tokens"]["embedding"]
    embedding[...] = embedding[...] * 20.0  # sharp logits: argmax not decided by rounding
    total = tree_bytes(params)
    one = engine(1, graphdef)
    key = jax.random.key(3)
    greedy1 = one.generate(params, PROMPTS, key, greedy=True)
    sampled1 = one.generate(params, PROMPTS, key, temperature=0.8, top_p=0.9)
    tp = 4
    eng = engine(tp, graphdef)
    greedy = eng.generate(params, PROMPTS, key, greedy=True)
    sampled = eng.generate(params, PROMPTS, key, temperature=0.8, top_p=0.9)
    placed = eng.place(params)
    held = device_bytes(placed)
    replicated = sum(tree_bytes(x) for x in jax.tree.leaves(placed) if x.sharding.is_fully_replicated)
    # The compiled decode loop (after SPMD partitioning): per-device cache slabs [B, KV / tp, L, Dh].
    tokens, mask, active = eng._pack(PROMPTS, [len(p) for p in PROMPTS])
    slots = tokens.shape[1] + NEW - 1
    hlo = eng._generate.lower(placed, *eng.mesh.replicate((tokens, mask, active, key, np.float32(1),
                                                            np.float32(1), np.bool_(True),
                                                            np.full((1, 1), -1, np.int32),
                                                            np.zeros((1, 1), bool)))).compile().as_text()
    shard_cache = f"f32[8,{MODEL.n_kv_heads // tp},{slots},{MODEL.head_dim}]"
    whole_cache = f"f32[8,{MODEL.n_kv_heads},{slots},{MODEL.head_dim}]"
    print(json.dumps({"check": "engine", "tp": tp, "greedy": compare(greedy1, greedy),
                      "sampled": compare(sampled1, sampled), "devices": len(held),
                      "max_device_bytes": max(held.values()), "total_bytes": total,
                      "replicated_bytes": replicated, "cache_split": shard_cache in hlo,
                      "cache_whole": whole_cache in hlo, "compilations": eng.num_compilations}), flush=True)

    # A weight publication: the learner's WeightServer, the actor process's RemoteWeights with the
    # engine's template (actor_process._build), then sampling with what arrived.
    ctx = zmq.Context()  # the same engine: its program is compiled already
    server = WeightServer("tcp://127.0.0.1:0", ctx=ctx).start()
    clients: list = []
    try:
        server.publish(5, lambda: named_arrays(params))
        skeleton = llama.abstract_params(MODEL)[1]
        weights = RemoteWeights(lambda endpoint: clients.append(WeightClient(endpoint, ctx=ctx)) or clients[-1],
                                eng.abstract_params(skeleton),
                                endpoint_fn=lambda: server.endpoint, timeout=30)
        weights.ensure(5)
        got, version = weights.latest()
        held = device_bytes(got)
        want = jax.tree.leaves(eng.abstract_params(skeleton))
        result = eng.generate(got, PROMPTS, key, greedy=True)
        print(json.dumps({"check": "published", "version": version, "greedy": compare(greedy1, result),
                          "in_engine_shards": all(x.sharding == w.sharding for x, w in zip(jax.tree.leaves(got), want)),
                          "devices": len(held), "max_device_bytes": max(held.values()), "total_bytes": total}),
              flush=True)
    finally:
        for client in clients:
            client.close()
        server.stop()
        ctx.term()


if __name__ == "__main__":
    main()
