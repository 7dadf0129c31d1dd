"""GRPO updates of a Llama-shaped model at real sizes: tokens/s, MFU and peak memory, vs a bare step.

Random init (no checkpoint needed), bf16 params and matmuls with float32 Adam moments, remat per
decoder block, the learner's mesh over every local device. Ours: GRPOTrainStep.update on host
microbatches (copies, accumulation over fixed-shape microbatches, apply, metrics fetched). Bare:
one jax.jit of value_and_grad + the same optax update over the whole batch already on the
devices, with the same shardings. MFU counts the model's FLOPs (6 x params x tokens + attention
12 x layers x d_model x seq_len per token), not remat's recomputation, against --peak-tflops.

    python benchmarks/learner_scale_bench.py --preset 0.5b --seq-len 1024 --batch 32 --microbatch 8
    python benchmarks/learner_scale_bench.py --preset tiny --devices 4 --fsdp 2 --tensor 2   # CPU dry run
    python benchmarks/learner_scale_bench.py --preset 14b --fsdp 8 --ckpt /tmp/ckpt-14b --no-bare

--ckpt DIR loads the params from the Hugging Face checkpoint there, straight into the mesh (each
device receives only its slices: learner/models/hf_load.py), instead of the random init; a DIR
without config.json first gets a random checkpoint of --preset written there (initialised in the
mesh, exported one shard file at a time), so a model larger than one device loads and trains.

Prints one JSON line. Written for benchmarks/gpu_learner.sh; not yet run on a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import numpy as np
import optax

if "--devices" in sys.argv:  # CPU devices: XLA fixes their number when JAX starts
    jax.config.update("jax_num_cpu_devices", int(sys.argv[sys.argv.index("--devices") + 1]))

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_timing import median_seconds  # noqa: E402

from cadence.learner import packing, sharding  # noqa: E402
from cadence.learner.batching import build_microbatches  # noqa: E402
from cadence.learner.config import LearnerConfig, MeshConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.steps.grpo_step import GRPOTrainStep  # noqa: E402
from cadence.learner.steps.scoring import llama_logits  # noqa: E402
from cadence.protocols.testing import rollout_group  # noqa: E402

from model_shapes import SHAPES, peak_bytes  # noqa: E402,F401  (peak_bytes: rl_loop_bench imports it from here)

# "tiny": a CPU size; the rest real checkpoints' shapes (model_shapes.py)
PRESETS = {
    "tiny": dict(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512),
    "0.5b": SHAPES["qwen2.5-0.5b"], "1.5b": SHAPES["qwen2.5-1.5b"], "14b": SHAPES["qwen2.5-14b"],
}
PEAK_TFLOPS = {"NVIDIA H200": 989.0, "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA A100-SXM4-80GB": 312.0}


def make_groups(batch: int, group: int, seq_len: int, vocab: int, seed: int = 0, lengths: str = "full"):
    """Groups whose prompts take a quarter of seq_len; completions fill the rest ("full") or follow
    a long tail ("mix": lognormal around seq_len / 8, clipped to [30, the rest]), as RL's do."""
    rng = np.random.default_rng(seed)
    prompt_len = seq_len // 4
    room = seq_len - prompt_len
    out = []
    for i in range(batch // group):
        prompt = [1] + [int(x) for x in rng.integers(3, vocab, prompt_len - 1)]
        sizes = ([room] * group if lengths == "full" else
                 np.clip(rng.lognormal(np.log(max(room // 6, 30)), 0.8, group), min(30, room), room).astype(int))
        comps = [[int(x) for x in rng.integers(3, vocab, n)] for n in sizes]
        out.append(rollout_group(f"p{i}", "bench", prompt, comps, [[-1.0] * len(c) for c in comps],
                                 [float(rng.random() < 0.5) for _ in comps], 0))
    return out


def load_into_mesh(ckpt: str, mcfg: ModelConfig, layout) -> dict:
    """The params read from the checkpoint at ckpt straight into layout's shards (a random one of
    mcfg written there first if it has none: initialised in the mesh, freed before the load);
    {"graphdef", "params", "ckpt_write_s", "load_s", "load_peak_bytes"}."""
    import os

    from cadence.learner.models import hf_config, hf_export, hf_load

    out = {"ckpt": ckpt, "ckpt_write_s": None}
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        t0 = time.perf_counter()
        _, random = llama.init_params(mcfg, 0, layout.params)
        hf_export.export_checkpoint(mcfg, random, ckpt)  # one shard file's tensors on the host at a time
        del random
        out["ckpt_write_s"] = round(time.perf_counter() - t0, 2)
    cfg = hf_config.model_config_from_checkpoint(ckpt, mcfg)
    if llama.count_params(llama.abstract_params(cfg)[1]) != llama.count_params(layout.abstract):
        raise SystemExit(f"--ckpt: {ckpt} holds another architecture than --preset")
    t0 = time.perf_counter()
    graphdef, loaded = hf_load.load_params(ckpt, cfg, layout.params)
    jax.block_until_ready(loaded)
    out.update(graphdef=graphdef, params=loaded, load_s=round(time.perf_counter() - t0, 2), load_peak_bytes=peak_bytes())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=32, help="samples per update")
    p.add_argument("--microbatch", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--remat", choices=["none", "block", "full"], default="block")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--devices", type=int, default=0, help="CPU devices to make (0: the platform's own)")
    p.add_argument("--data", type=int, default=1)
    p.add_argument("--fsdp", type=int, default=-1)
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--logits-chunk", type=int, default=LearnerConfig().logits_chunk,
                   help="learner.logits_chunk (0: whole [B, T, V] logits)")
    p.add_argument("--lengths", choices=["full", "mix"], default="full",
                   help="completion lengths: every row full, or a long-tail mix")
    p.add_argument("--microbatch-tokens", type=int, default=0,
                   help="learner.microbatch_tokens (0: one sample per row; > 0: packed rows)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak (0: by device kind)")
    p.add_argument("--no-bare", action="store_true", help="skip the bare step (saves its memory)")
    p.add_argument("--ckpt", default="", help="load from this HF checkpoint into the mesh (written first if absent)")
    args = p.parse_args()

    mcfg = ModelConfig(**PRESETS[args.preset], max_seq_len=args.seq_len, param_dtype=args.dtype,
                       compute_dtype=args.dtype)
    mesh = MeshConfig(data=args.data, fsdp=args.fsdp, tensor=args.tensor)
    cfg = LearnerConfig(batch_size=args.batch, microbatch_size=args.microbatch, group_size=args.group,
                        mesh=mesh, remat=args.remat, logits_chunk=args.logits_chunk,
                        microbatch_tokens=args.microbatch_tokens)
    cfg.validate()
    _, abstract = llama.abstract_params(mcfg)
    layout = sharding.make_layout(mesh, abstract, force=True)
    init_s, loaded = None, {}
    if args.ckpt:
        loaded = load_into_mesh(args.ckpt, mcfg, layout)
        graphdef, params = loaded.pop("graphdef"), loaded.pop("params")
    else:
        t0 = time.perf_counter()
        graphdef, params = llama.init_params(mcfg, 0, layout.params)
        jax.block_until_ready(params)
        init_s = time.perf_counter() - t0
    step = GRPOTrainStep(llama_logits(graphdef, args.remat), cfg, layout=layout)
    groups = make_groups(args.batch, args.group, args.seq_len, mcfg.vocab_size, lengths=args.lengths)
    if args.microbatch_tokens:
        rows = packing.rows_per_microbatch(args.microbatch_tokens, args.seq_len, layout.rows)
        mbs, stats = packing.pack_microbatches(groups, args.seq_len, rows, 0, cfg.grpo)
    else:
        mbs, stats = build_microbatches(groups, args.seq_len, args.microbatch, 0, cfg.grpo)
    real_tokens = int(sum(len(g.prompt_tokens) * len(g.rewards) for g in groups)
                      + sum(int(np.asarray(mb.loss_mask).sum()) for mb in mbs))
    state = {"s": step.init(params)}
    del params

    def ours():
        state["s"], metrics = step.update(state["s"], mbs, stats["num_tokens"])

    t0 = time.perf_counter()
    ours()
    first_s = time.perf_counter() - t0
    ours_t = median_seconds(ours, args.repeats, 1, warmup=1)
    peak_ours = peak_bytes()

    bare_t = None
    if not args.no_bare:
        if args.microbatch_tokens:  # the same packed rows, all in one program
            _, probe = packing.pack_microbatches(groups, args.seq_len, args.batch, 0, cfg.grpo)
            (full,), _ = packing.pack_microbatches(groups, args.seq_len, probe["packed_rows"], 0, cfg.grpo)
        else:
            (full,), _ = build_microbatches(groups, args.seq_len, args.batch, 0, cfg.grpo)
        tx = step.optimizer

        def bare_impl(params, opt_state, batch, n):
            _, grads = jax.value_and_grad(step.loss_fn, has_aux=True)(params, batch, n)
            updates, opt_state = tx.update(sharding.fp32_grads(grads), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        o = layout.opt_state(tx)
        rows = type(full)(*(None if x is None else layout.batch for x in full))  # packed: no rewards
        bare = jax.jit(bare_impl, in_shardings=(layout.params, o, rows, layout.replicated),
                       out_shardings=(layout.params, o), donate_argnums=(0, 1))
        fields = layout.put_batch([np.asarray(x) for x in full if x is not None])
        batch = type(full)(*(None if x is None else fields.pop(0) for x in full))
        n = layout.scalar(stats["num_tokens"])
        bs = {"p": state["s"].params, "o": state["s"].opt_state}
        state.clear()  # the bare step holds (and donates) the one copy of the model

        def run_bare():
            bs["p"], bs["o"] = bare(bs["p"], bs["o"], batch, n)
            jax.block_until_ready(bs["p"])

        try:
            bare_t = median_seconds(run_bare, args.repeats, 1, warmup=1)
        except Exception as e:  # e.g. the whole batch at once does not fit: ours still counts
            print(f"bare step failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)

    n_params = llama.count_params(abstract)
    tokens = real_tokens  # prompt + completion tokens of the samples, not padding
    flops_per_token = 6 * n_params + 12 * mcfg.n_layers * mcfg.d_model * args.seq_len
    kind = jax.devices()[0].device_kind
    peak = args.peak_tflops or PEAK_TFLOPS.get(kind, 0.0)
    achieved = flops_per_token * tokens / ours_t / 1e12
    print(json.dumps({
        "bench": "learner_scale", "preset": args.preset, "device": kind, "devices": len(jax.devices()),
        "mesh": dict(layout.mesh.shape), "params": n_params, "dtype": args.dtype, "remat": args.remat,
        "logits_chunk": args.logits_chunk,
        "batch": args.batch, "microbatch": args.microbatch, "seq_len": args.seq_len,
        "lengths": args.lengths, "microbatch_tokens": args.microbatch_tokens,
        "num_microbatches": len(mbs), "row_fill": round(real_tokens / (len(mbs) * mbs[0].tokens.size), 3),
        "ours_tokens_per_s": round(tokens / ours_t, 1),
        "bare_tokens_per_s": None if bare_t is None else round(tokens / bare_t, 1),
        "ratio": None if bare_t is None else round(bare_t / ours_t, 3),
        "tflops_per_device": round(achieved / len(jax.devices()), 2),
        "mfu": round(achieved / len(jax.devices()) / peak, 4) if peak else None,
        "param_shard_bytes": sharding.shard_bytes(layout.abstract, layout.params),  # one device's params
        "peak_bytes_ours": peak_ours, "peak_bytes_with_bare": peak_bytes(),
        "init_s": init_s and round(init_s, 2), "first_update_s": round(first_s, 2), **loaded,
        "compiles": step.cache_sizes(),
        "config": dataclasses.asdict(mcfg),
    }))


if __name__ == "__main__":
    main()
