"""The built-in engine decoding tensor-parallel (engine.tensor_parallel): tokens/s and per-device
param bytes at tp 1 (the baseline, one device) vs tp 2, 4, 8 on the same model.

Random init straight into each engine's shards (a model larger than one device never exists
whole), the same seed for every tp, so the greedy tokens of every tp can be compared with tp 1's.
EOS is disabled: every row produces every token. Tokens/s is the median over --repeats of whole
generate() calls (host packing, the jitted decode loop, transfer back), after a compile call.
Per-device param bytes are counted from the placed arrays' shards; peak bytes (GPUs) come from
the devices' own memory stats.

    python benchmarks/engine_tp_bench.py --devices 4 --tp 1,2,4          # forced CPU devices
    python benchmarks/engine_tp_bench.py --preset 8b --tp 1,8 --dtype bfloat16 --batch 64 \\
        --prompt-len 128 --new-tokens 128                                # an 8-GPU host
    python benchmarks/engine_tp_bench.py --preset 70b --tp 8 --dtype bfloat16   # one GPU cannot hold it

On CPU devices all "devices" share the same cores, so tp is not faster there (it adds the
collectives): the CPU run shows that it runs, that the tokens match, and the memory split.
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

if "--devices" in sys.argv:  # CPU devices: XLA fixes their number when JAX starts
    jax.config.update("jax_num_cpu_devices", int(sys.argv[sys.argv.index("--devices") + 1]))

import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_timing import median_seconds  # noqa: E402  (benchmarks/ is the script's own dir)

from cadence.actors.engine import EngineConfig, JaxEngine  # noqa: E402
from cadence.actors.engine_mesh import device_bytes  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.sharding import tree_bytes  # noqa: E402

from model_shapes import SHAPES, peak_bytes  # noqa: E402

# "tiny" and "small": CPU sizes; the rest real checkpoints' shapes (model_shapes.py)
PRESETS = {
    "tiny": dict(vocab_size=256, d_model=128, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=512),
    "small": dict(vocab_size=4096, d_model=512, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=2048),
    "1.5b": SHAPES["qwen2.5-1.5b"], "8b": SHAPES["llama3-8b"], "70b": SHAPES["llama3-70b"],
}


def run_tp(cfg: ModelConfig, tp: int, args, prompts) -> tuple[dict, np.ndarray]:
    graphdef, abstract = llama.abstract_params(cfg)
    ecfg = EngineConfig(max_new_tokens=args.new_tokens, batch_buckets=(args.batch,), prompt_bucket=args.prompt_len,
                        tensor_parallel=tp)
    engine = JaxEngine(cfg, graphdef, ecfg, eos_id=cfg.vocab_size, pad_id=0)
    t0 = time.perf_counter()
    shardings = None if engine.mesh is None else engine.mesh.shardings(abstract)
    params = engine.place(llama.init_params(cfg, 0, shardings)[1])
    jax.block_until_ready(params)
    init_s = time.perf_counter() - t0
    rng = jax.random.key(0)
    t0 = time.perf_counter()
    first = engine.generate(params, prompts, rng, greedy=True)
    first_s = time.perf_counter() - t0
    assert first.num_tokens == args.batch * args.new_tokens, "EOS is disabled: every row makes every token"
    seconds = median_seconds(lambda: engine.generate(params, prompts, rng, greedy=True), args.repeats, 1)
    held = device_bytes(params)
    devices = jax.local_devices()[:tp]
    row = {"tp": tp, "tokens_per_s": round(first.num_tokens / seconds, 1), "seconds_per_call": round(seconds, 4),
           "param_bytes_per_device": max(held.values()), "devices_holding_params": len(held),
           "peak_bytes_per_device": peak_bytes(devices), "init_s": round(init_s, 2),
           "first_call_s": round(first_s, 2), "compilations": engine.num_compilations}
    tokens = first.tokens
    del params, engine
    return row, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--tp", default="1,2,4", help="tensor-parallel sizes, comma-separated (1 = the baseline)")
    p.add_argument("--devices", type=int, default=0, help="CPU devices to make (0: the platform's own)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    sizes = [int(t) for t in args.tp.split(",")]
    cfg = ModelConfig(**PRESETS[args.preset], max_seq_len=args.prompt_len + args.new_tokens, param_dtype=args.dtype,
                      compute_dtype=args.dtype)
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
    abstract = llama.abstract_params(cfg)[1]
    # Largest tp first: a device's peak-memory count lasts the whole process, and tp 1's model on
    # device 0 would otherwise show in every later run's peak there.
    runs = {tp: run_tp(cfg, tp, args, prompts) for tp in sorted(set(sizes), reverse=True)}
    rows = []
    for tp in sorted(runs):
        row, tokens = runs[tp]
        if tp > 1 and 1 in runs:  # same seed, same init whatever the sharding (threefry is partitionable)
            row["same_greedy_tokens_as_tp1"] = bool(np.array_equal(tokens, runs[1][1]))
        rows.append(row)
    kind = jax.devices()[0].device_kind
    print(json.dumps({
        "bench": "engine_tp", "preset": args.preset, "device": kind, "platform": jax.devices()[0].platform,
        "devices": len(jax.devices()), "params": llama.count_params(abstract), "param_bytes": tree_bytes(abstract),
        "dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "runs": rows,
        "note": ("CPU devices share one machine's cores: tp is not faster here (it adds collectives); the "
                 "point is the per-device param bytes (1/tp) and that tp decodes the same tokens")
        if jax.devices()[0].platform == "cpu" else "tp decodes on tp devices; tp 1 is one device",
    }))


if __name__ == "__main__":
    main()
