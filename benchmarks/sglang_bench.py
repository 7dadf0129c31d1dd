"""Generation tokens/s through Cadence's SGLang engine vs a bare asyncio HTTP client (sglang-jax).

    CADENCE_SGLANG_PYTHON=~/sglang-jax/bin/python python benchmarks/sglang_bench.py
    ... --model small --launch-args "--device gpu ..." --launch-env JAX_PLATFORMS=cuda   # an accelerator

Both drive the same server (one Cadence launched, serving a tiny exported Llama) with the same
prompts, sampling params and concurrency; the bare client is the floor of HTTP overhead: an
aiohttp session, a semaphore, no checks. Alternating rounds, best of each. Then a weight sync
(sglang-jax has no update endpoint: a restart on the new checkpoint) and the mismatch between the
server's sampling logprobs and Cadence's JAX model (float32) on the same tokens: KL(server ||
learner) estimated from the sampled tokens (mean of log p_server - log p_learner). Prints one JSON
line; the goal is ratio >= 0.9.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time

import aiohttp
import jax.numpy as jnp
import numpy as np

from cadence.actors.config import SGLangConfig
from cadence.actors.sglang.checkpoint import export_for_server
from cadence.actors.sglang.engine import SGLangEngine
from cadence.actors.sglang.server import CPU_ARGS
from cadence.actors.sglang.testing import sglang_python, tiny_server_model
from cadence.learner.algorithms.logprobs import token_logprobs_and_entropy
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.llama import count_params, forward, init_params

MODELS = {
    "tiny": tiny_server_model(),  # what sglang-jax serves on 2 CPU cores
    # A small Llama for an accelerator (head_dim 128, as sglang-jax needs): about 170M params.
    "small": ModelConfig(vocab_size=32000, d_model=1024, n_heads=8, n_kv_heads=8, d_ff=4096, n_layers=8,
                         max_seq_len=512),
}


def logprob_mismatch(graphdef, params, prompts, result, rows: int = 32) -> dict:
    """Server logprobs of its sampled tokens vs Cadence's model on the same tokens."""
    diffs = []
    for r in range(min(rows, len(prompts))):
        n = int(result.lengths[r])
        toks = jnp.array([list(prompts[r]) + result.tokens[r, :n].tolist()])
        length = toks.shape[1]
        logits = forward(graphdef, params, toks, jnp.arange(length)[None], jnp.ones((1, length), bool))
        lp, _ = token_logprobs_and_entropy(logits, toks)
        diffs.append(result.logprobs[r, :n] - np.asarray(lp[0, len(prompts[r]):]))
    d = np.concatenate(diffs)
    return {"mismatch_kl_k1": float(d.mean()), "logprob_mean_abs_diff": float(np.abs(d).mean()),
            "logprob_max_abs_diff": float(np.abs(d).max()), "mismatch_tokens": int(d.size)}


async def bare(url: str, prompts, sampling, concurrency: int) -> int:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one(p):
            async with sem:
                async with session.post(url + "/generate", json={"input_ids": p, "sampling_params": sampling,
                                                                 "return_logprob": True}) as r:
                    return (await r.json())["meta_info"]["completion_tokens"]
        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--launch-args", default=shlex.join(CPU_ARGS), help="the server's arguments (one string)")
    ap.add_argument("--launch-env", nargs="*", default=["JAX_PLATFORMS=cpu"], help="KEY=VALUE for the server")
    args = ap.parse_args()
    python = sglang_python()
    if not python:
        raise SystemExit("set CADENCE_SGLANG_PYTHON to the python of the sglang-jax venv")
    model_cfg = MODELS[args.model]
    graphdef, params = init_params(model_cfg, 0)
    _, params_next = init_params(model_cfg, 1)
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(4, 14, size=8).tolist() for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as work:
        cfg = SGLangConfig(launch_python=python, concurrency=args.concurrency,
                           launch_args=tuple(shlex.split(args.launch_args)), launch_env=tuple(args.launch_env))
        # EOS outside the vocabulary: every request generates max_new_tokens, on both sides.
        engine = SGLangEngine(cfg, max_new_tokens=args.max_new_tokens, eos_id=10**6, pad_id=0, work_dir=work,
                              export_fn=lambda p, d: export_for_server(model_cfg, p, d))
        try:
            t0 = time.perf_counter()
            engine.sync_weights(params, 0)
            startup = time.perf_counter() - t0
            url = engine.servers[0].client.base_url
            sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "top_p": 1.0,
                        "stop_token_ids": [10**6], "skip_special_tokens": False, "no_stop_trim": True}
            engine.generate(None, prompts[: args.concurrency], None)  # warm both paths
            asyncio.run(bare(url, prompts[: args.concurrency], sampling, args.concurrency))
            cadence, baseline = [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                res = engine.generate(None, prompts, None)
                cadence.append(res.num_tokens / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                n = asyncio.run(bare(url, prompts, sampling, args.concurrency))
                baseline.append(n / (time.perf_counter() - t0))
            mismatch = logprob_mismatch(graphdef, params, prompts, res)
            t0 = time.perf_counter()
            engine.sync_weights(params_next, 1)  # restart on the new checkpoint
            restart_sync = time.perf_counter() - t0
            after = logprob_mismatch(graphdef, params_next, prompts, engine.generate(None, prompts[:32], None))
        finally:
            engine.close()
    model = (f"llama d_model {model_cfg.d_model}, {model_cfg.n_layers} layers, vocab {model_cfg.vocab_size} "
             f"({count_params(params) / 1e6:.1f}M params)")
    print(json.dumps({"bench": "sglang", "server": "sglang-jax 0.1.0rc0", "model": model,
                      "launch_args": args.launch_args, "launch_env": args.launch_env,
                      "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                      "concurrency": args.concurrency, "server_start_s": round(startup, 1),
                      "cadence_tokens_per_s": round(max(cadence), 1), "bare_tokens_per_s": round(max(baseline), 1),
                      "ratio": round(max(cadence) / max(baseline), 3),
                      "misaligned": engine.stats.misaligned, "reissued": engine.stats.reissued,
                      "restart_sync_s": round(restart_sync, 1), **mismatch,
                      "mismatch_kl_k1_after_sync": after["mismatch_kl_k1"],
                      "logprob_max_abs_diff_after_sync": after["logprob_max_abs_diff"]}))


if __name__ == "__main__":
    main()
