"""LoRA against full fine-tuning on SmolLM2-135M: learner tokens/s, the bytes of what the learner
holds (params + Adam), and the bytes one weight publication would carry, same batch, same run.
And the built-in engine's decode with the adapters merged once per version against unmerged, and
seconds until 2 actor processes hold a publication (bytes over ZeroMQ, as RemoteWeights fetches).
One JSON line.

    nice -n 5 python benchmarks/lora.py                      # rank 16, batch 8 x 128 tokens, 3 timed updates
    python benchmarks/lora.py --rank 16 --batch 8 --seq-len 128 --updates 3

The checkpoint is the real-model fixture (benchmarks/real_model.py prepare). Both learners train
the same microbatches; the first update of each compiles and is not timed. "full" holds the
params and two Adam moments; "lora" the frozen base, the adapters and their two moments (the
moments and gradients of adapters only). publish_bytes: what one publication to an actor process
carries (the model, or the adapters alone). Updates alternate between the two learners, and the
process CPU seconds are reported beside wall time, so load from other processes falls on both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

from learner_scale_bench import make_groups  # noqa: E402


def tree_bytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def measure(steps: dict, params: dict, mbs, num_tokens, updates: int, real_tokens: int) -> dict:
    """Alternates the learners' updates (full, lora, full, ...) so that load from other processes
    falls on both alike; wall and process-CPU seconds per update, and the bytes each one holds."""
    states = {}
    for name, step in steps.items():
        states[name] = step.init(params[name])
        states[name], _ = step.update(states[name], mbs, num_tokens)  # compiles
        jax.block_until_ready(states[name].params)
    wall = {name: 0.0 for name in steps}
    cpu = {name: 0.0 for name in steps}
    for _ in range(updates):
        for name, step in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            states[name], _ = step.update(states[name], mbs, num_tokens)
            jax.block_until_ready(states[name].params)
            wall[name] += time.perf_counter() - t0
            cpu[name] += time.process_time() - c0
    out = {}
    for name, step in steps.items():
        state = states[name]
        frozen = tree_bytes(step.frozen) if getattr(step, "frozen", None) is not None else 0
        out[name] = {
            "tokens_per_s": round(real_tokens * updates / wall[name], 1), "update_s": round(wall[name] / updates, 3),
            "cpu_s_per_update": round(cpu[name] / updates, 3),
            "trainable_params": int(sum(x.size for x in jax.tree.leaves(state.params))),
            "params_bytes": tree_bytes(state.params) + frozen, "opt_state_bytes": tree_bytes(state.opt_state),
            "resident_bytes": tree_bytes(state.params) + frozen + tree_bytes(state.opt_state),
            "publish_bytes": tree_bytes(state.params)}  # LoRA: the adapters an actor process fetches
    return out


def decode(model_cfg, graphdef, base, lgraphdef, adapters, lora_cfg, tokens: int, rows: int, repeats: int = 2) -> dict:
    """The built-in engine at decode: base + adapters merged once per version (the plain model's
    program on merged weights; the merge timed too) against the LoRA model run unmerged."""
    import functools

    from cadence.actors.engine import EngineConfig, JaxEngine
    from cadence.learner.models import lora

    cfg = EngineConfig(max_new_tokens=tokens)
    prompts = [[1] + [3 + (7 * i + j) % 1000 for j in range(31)] for i in range(rows)]
    merge = jax.jit(functools.partial(lora.merge_weights, lora_cfg=lora_cfg))
    jax.block_until_ready(merge(base, adapters))  # compiles
    t0 = time.perf_counter()
    merged = jax.block_until_ready(merge(base, adapters))
    merge_s = time.perf_counter() - t0
    runs = {"merged": (JaxEngine(model_cfg, graphdef, cfg, -1, 0), merged),
            "unmerged": (JaxEngine(model_cfg, lgraphdef, cfg, -1, 0), lora.join(base, adapters))}
    seconds = {name: 0.0 for name in runs}
    for name, (engine, params) in runs.items():
        engine.generate(params, prompts, jax.random.key(0))  # compiles
    for r in range(repeats):  # interleaved, as the updates are
        for name, (engine, params) in runs.items():
            t0 = time.perf_counter()
            engine.generate(params, prompts, jax.random.key(r))
            seconds[name] += (time.perf_counter() - t0) / repeats
    return {"rows": rows, "new_tokens": tokens, "merge_s": round(merge_s, 3),
            **{f"{k}_tokens_per_s": round(rows * tokens / v, 1) for k, v in seconds.items()}}


def _fetcher(endpoint, rounds, ready, go, done):
    """An actor process's half of a publication: fetch the newest arrays (bytes only)."""
    import zmq

    from cadence.protocols.weights_wire import WeightClient

    client = WeightClient(endpoint, ctx=zmq.Context())
    have = -1
    ready.put(1)
    for _ in range(rounds):
        v = go.get()
        have, named = client.fetch(have)
        done.put((v, time.time(), sum(a.nbytes for _, a in named)))


def publication(named: dict, actors: int = 2, rounds: int = 3) -> dict:
    """Seconds from a publication until `actors` processes hold its bytes (median over rounds),
    per kind of publication ({"full": named arrays, "lora": ...}), the kinds' rounds alternating."""
    import multiprocessing as mp
    import statistics

    import zmq

    from cadence.protocols.weights_wire import WeightServer

    ctx = zmq.Context()
    spawn = mp.get_context("spawn")
    setups = {}
    for kind in named:
        server = WeightServer("tcp://127.0.0.1:0", ctx=ctx).start()
        ready, done, gos = spawn.Queue(), spawn.Queue(), [spawn.Queue() for _ in range(actors)]
        procs = [spawn.Process(target=_fetcher, args=(server.endpoint, rounds, ready, go, done)) for go in gos]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=300)
        setups[kind] = (server, procs, gos, done)
    seconds = {kind: [] for kind in named}
    for v in range(1, rounds + 1):
        for kind, (server, procs, gos, done) in setups.items():
            t0 = time.time()
            server.publish(v, lambda k=kind: named[k])
            for go in gos:
                go.put(v)
            got = [done.get(timeout=600) for _ in procs]
            seconds[kind].append(max(g[1] for g in got) - t0)
    out = {}
    for kind, (server, procs, _, _) in setups.items():
        for p in procs:
            p.join()
        out[kind] = {"seconds": round(statistics.median(seconds[kind]), 3),
                     "bytes_per_actor": int(sum(a.nbytes for _, a in named[kind]))}
        server.stop()
    ctx.destroy(linger=0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=32, help="0: skip the engine's merged/unmerged decode")
    p.add_argument("--publish-rounds", type=int, default=3, help="0: skip the publication to 2 actor processes")
    args = p.parse_args()

    from real_model import smollm2_dir

    from cadence.learner.batching import build_microbatches
    from cadence.learner.config import LearnerConfig, LoraConfig, SFTConfig
    from cadence.learner.models import hf_load, lora
    from cadence.learner.models.config import ModelConfig
    from cadence.learner.steps import make_train_step

    model_cfg, graphdef, base = hf_load.load_checkpoint(str(smollm2_dir()), ModelConfig())
    groups = make_groups(args.batch, args.group, args.seq_len, model_cfg.vocab_size)

    def cfg(rank: int) -> LearnerConfig:
        c = LearnerConfig(batch_size=args.batch, microbatch_size=args.batch, group_size=args.group,
                          sft=SFTConfig(steps=0), lora=LoraConfig(rank=rank, alpha=args.alpha))
        c.validate()
        return c

    mbs, stats = build_microbatches(groups, args.seq_len, args.batch, 0, cfg(0).grpo)
    real = int(sum(len(g.prompt_tokens) * len(g.rewards) + len(g.completion_tokens.values) for g in groups))
    lora_cfg = cfg(args.rank)
    lgraphdef, adapters = lora.init_adapters(model_cfg, lora_cfg.lora, seed=0)
    steps = {"full": make_train_step(graphdef, cfg(0)), "lora": make_train_step(lgraphdef, lora_cfg)}
    out = measure(steps, {"full": base, "lora": lora.join(base, adapters)}, mbs, stats["num_tokens"],
                  args.updates, real)
    out_full, out_lora = out["full"], out["lora"]
    decoded = decode(model_cfg, graphdef, base, lgraphdef, jax.tree.map(lambda x: x + 0.01, adapters), lora_cfg.lora,
                     args.decode_tokens, args.batch) if args.decode_tokens else None
    from cadence.learner.models.named_arrays import named_arrays
    published = publication({"full": named_arrays(base), "lora": named_arrays(adapters)},
                            rounds=args.publish_rounds) if args.publish_rounds else None
    print(json.dumps({
        "benchmark": "lora", "model": "smollm2-135m", "device": jax.devices()[0].device_kind,
        "rank": args.rank, "batch": args.batch, "seq_len": args.seq_len, "tokens_per_update": real,
        "full": out_full, "lora": out_lora,
        "speedup": round(out_lora["tokens_per_s"] / out_full["tokens_per_s"], 2),
        "cpu_ratio": round(out_lora["cpu_s_per_update"] / out_full["cpu_s_per_update"], 2),
        "publish_ratio": round(out_lora["publish_bytes"] / out_full["publish_bytes"], 4),
        "resident_ratio": round(out_lora["resident_bytes"] / out_full["resident_bytes"], 3),
        "decode": decoded, "publish_to_2_actor_processes": published,
    }))


if __name__ == "__main__":
    main()
