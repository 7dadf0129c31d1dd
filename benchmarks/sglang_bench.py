"""Generation tokens/s through Cadence's SGLang engine vs a bare asyncio HTTP client (CPU, sglang-jax).

    CADENCE_SGLANG_PYTHON=~/sglang-jax/bin/python python benchmarks/sglang_bench.py

Both drive the same server (one Cadence launched, serving a tiny exported Llama) with the same
prompts, sampling params and concurrency; the bare client is the floor of HTTP overhead: an
aiohttp session, a semaphore, no checks. Alternating rounds, best of each. Prints one JSON line;
the goal is ratio >= 0.9.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import aiohttp
import numpy as np

from actors.config import SGLangConfig
from actors.sglang.checkpoint import export_for_server
from actors.sglang.engine import SGLangEngine
from actors.sglang.testing import sglang_python, tiny_server_model
from learner.models.llama import init_params


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
    args = ap.parse_args()
    python = sglang_python()
    if not python:
        raise SystemExit("set CADENCE_SGLANG_PYTHON to the python of the sglang-jax venv")
    model_cfg = tiny_server_model()
    _, params = init_params(model_cfg, 0)
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(4, 14, size=8).tolist() for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as work:
        cfg = SGLangConfig(launch_python=python, concurrency=args.concurrency)
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
        finally:
            engine.close()
    print(json.dumps({"bench": "sglang_cpu", "server": "sglang-jax 0.1.0rc0", "model": "llama hidden256 2heads 1layer",
                      "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                      "concurrency": args.concurrency, "server_start_s": round(startup, 1),
                      "cadence_tokens_per_s": round(max(cadence), 1), "bare_tokens_per_s": round(max(baseline), 1),
                      "ratio": round(max(cadence) / max(baseline), 3),
                      "misaligned": engine.stats.misaligned, "reissued": engine.stats.reissued}))


if __name__ == "__main__":
    main()
