"""Engine speed at a real size: Cadence's JaxEngine vs transformers' ``generate`` on SmolLM2-135M.

Setup: the SmolLM2-135M-Instruct checkpoint from ``${CADENCE_CACHE:-~/.cache/cadence}/smollm2-135m-instruct``
(``benchmarks/real_model.py prepare``), or, when it is not there (or with ``--random``), a
random-init checkpoint of the same shape (30 layers, d 576, 9/3 heads, d_ff 1536, vocab 49152, tied
embeddings) written by ``learner/models/hf_random.py``: with lengths forced, speed does not depend on
the weights. Both sides load the same files, float32, on the CPU.

Prompts: ~60 tokens each (the checkpoint's chat template around short word problems; random ids of
52-64 tokens for the random model), left-padded for transformers exactly as the engine pads them.
Sampling at temperature 1, top_p 1, no top-k, 256 new tokens.

Per batch size, two modes:
- ``forced``: every row generates exactly 256 tokens (equal work). transformers gets
  ``min_new_tokens=256``; the engine gets an EOS id outside the vocabulary.
- ``eos`` (real checkpoint only): the checkpoint's EOS ends rows early, as in RL. Both sides keep the
  batch in lock-step until every row has finished (or 256 tokens); ``tok_s`` counts only real tokens
  and ``steps`` / ``useful`` say how much of the lock-step batch was real work.

tokens/s = generated tokens / wall time of the whole call, after a warm-up call; the engine's compile
time (first call minus a steady call) is reported apart. transformers runs with each of
``--torch-threads`` (on a loaded 2-core machine torch's OpenMP threads at 2 can be several times
slower than at 1); ``hf_tok_s`` and ``ratio`` use its best. On a shared machine wall time also
depends on how many threads each side runs (a 2-thread process gets more of a busy CPU than a
1-thread one), so CPU-ms per generated token (user + system, all threads) is reported beside it and
``cpu_ratio`` compares those. One JSON line per configuration, the two sides measured back to back
in the same process; ``load_avg`` is the machine's 1-minute load then.
Run: ``nice -n 5 .venv/bin/python benchmarks/engine_real_bench.py [--batches 16 32] [--repeats 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from cadence.actors.engine import EngineConfig, JaxEngine  # noqa: E402
from cadence.learner.models import hf_load  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402

NEW_TOKENS = 256
SMOLLM2_SHAPE = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
                            max_seq_len=2048, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True)
QUESTIONS = [
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell in total?",
    "A baker makes 12 loaves every hour for 7 hours and sells 60 of them. How many loaves are left?",
    "Tom has 35 marbles. He gives 8 to Ann and buys 14 more. How many marbles does Tom have now?",
    "A train travels 64 miles per hour for 3 hours. How far does it travel in those 3 hours?",
    "Sara reads 25 pages a day. How many pages does she read in two weeks?",
    "A box holds 6 rows of 9 eggs. If 7 eggs break, how many eggs are still whole?",
    "Each ticket costs 13 dollars. How much do 8 tickets cost after a 10 dollar discount?",
    "There are 120 students split evenly into 5 buses. How many students ride on each bus?",
]


def default_checkpoint() -> pathlib.Path:
    return pathlib.Path(os.environ.get("CADENCE_CACHE", "~/.cache/cadence")).expanduser() / "smollm2-135m-instruct"


def is_checkpoint(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def chat_prompts(path: pathlib.Path, n: int) -> list[list[int]]:
    """The checkpoint's chat template around short word problems (~60 tokens each)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    prompts = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + " Put the final answer after ####."
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))  # BatchEncoding in transformers 5
    return prompts


def random_prompts(n: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, int(rng.integers(52, 65))).tolist() for _ in range(n)]


def left_padded(prompts, pad_id, bucket):
    """[B, P] ids and mask, padded on the left to the engine's prompt bucket (same block for both sides)."""
    p = bucket * -(-max(map(len, prompts)) // bucket)
    ids = np.full((len(prompts), p), pad_id, np.int64)
    mask = np.zeros((len(prompts), p), np.int64)
    for r, row in enumerate(prompts):
        ids[r, p - len(row):] = row
        mask[r, p - len(row):] = 1
    return ids, mask


def cpu_seconds() -> float:
    """This process's user + system CPU time (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(call, repeats, warmup=None):
    """(result of the last call, seconds of the warm-up call, median wall seconds and median CPU
    seconds of `repeats` further calls). warmup defaults to call itself."""
    start = time.perf_counter()
    (warmup or call)()
    first_s = time.perf_counter() - start
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), cpu_seconds()
        out = call()
        wall.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    return out, first_s, statistics.median(wall), statistics.median(cpu)


def bench_transformers(model, torch, prompts, pad_id, eos_id, forced, repeats, bucket, threads):
    torch.set_num_threads(threads)
    ids, mask = left_padded(prompts, pad_id, bucket)
    ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad_id, eos_token_id=eos_id)
    if forced:
        kwargs["min_new_tokens"] = NEW_TOKENS

    def call(new=NEW_TOKENS):
        torch.manual_seed(0)
        with torch.no_grad():
            return model.generate(input_ids=ids_t, attention_mask=mask_t, max_new_tokens=new,
                                  **dict(kwargs, min_new_tokens=min(new, kwargs.get("min_new_tokens", 0))))

    # The warm-up is short: there is nothing to compile.
    out, _, steady_s, cpu_s = timed(call, repeats, warmup=lambda: call(8))
    new = out[:, ids.shape[1]:].numpy()
    steps = new.shape[1]
    if forced:
        tokens = int(new.size)
    else:  # real tokens: up to and including the first EOS
        ends = [np.flatnonzero(row == eos_id) for row in new]
        tokens = int(sum(e[0] + 1 if e.size else steps for e in ends))
    return dict(tok_s=tokens / steady_s, seconds=steady_s, cpu_s=cpu_s, tokens=tokens, steps=steps)


def bench_engine(cfg, graphdef, params, prompts, pad_id, eos_id, forced, repeats, batch, bucket):
    ecfg = EngineConfig(max_new_tokens=NEW_TOKENS, batch_buckets=(batch,), prompt_bucket=bucket)
    engine = JaxEngine(cfg, graphdef, ecfg, eos_id=cfg.vocab_size if forced else eos_id, pad_id=pad_id)
    out, first_s, steady_s, cpu_s = timed(lambda: engine.generate(params, prompts, jax.random.key(0)), repeats)
    if forced:
        assert out.num_tokens == len(prompts) * NEW_TOKENS, "EOS disabled: every row makes every token"
    steps = int(out.lengths.max())  # the loop runs until the longest row ends
    return dict(tok_s=out.num_tokens / steady_s, seconds=steady_s, cpu_s=cpu_s, compile_s=max(first_s - steady_s, 0.0),
                tokens=out.num_tokens, steps=steps, compilations=engine.num_compilations)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per side after the warm-up call")
    parser.add_argument("--checkpoint", default=str(default_checkpoint()))
    parser.add_argument("--random", action="store_true", help="use a random-init SmolLM2-shaped checkpoint")
    parser.add_argument("--modes", nargs="+", default=["forced", "eos"], choices=["forced", "eos"])
    parser.add_argument("--sides", nargs="+", default=["cadence", "transformers"], choices=["cadence", "transformers"])
    parser.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2],
                        help="torch intra-op threads to measure transformers with (each reported; ratio uses the best)")
    args = parser.parse_args()

    import torch
    import transformers

    path = pathlib.Path(args.checkpoint)
    real = not args.random and is_checkpoint(path)
    tmp = None
    if not real:
        from cadence.learner.models.hf_random import write_random_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="smollm2-random-")
        path = pathlib.Path(tmp.name)
        write_random_checkpoint(str(path), SMOLLM2_SHAPE, seed=0, tokenizer=False)
    modes = args.modes if real else [m for m in args.modes if m == "forced"]  # random weights never say EOS

    cfg, graphdef, params = hf_load.load_checkpoint(str(path))
    hf = json.loads((path / "config.json").read_text())
    eos_id = hf.get("eos_token_id")
    eos_id = int(eos_id[0] if isinstance(eos_id, list) else (eos_id if eos_id is not None else cfg.vocab_size))
    pad_id = int(hf.get("pad_token_id") if hf.get("pad_token_id") is not None else eos_id % cfg.vocab_size)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    bucket = 8

    for batch in args.batches:
        prompts = chat_prompts(path, batch) if real else random_prompts(batch, cfg.vocab_size)
        for mode in modes:
            forced = mode == "forced"
            row = {"bench": "engine_real", "model": "smollm2-135m-instruct" if real else "smollm2-135m-random",
                   "mode": mode, "batch": batch, "prompt_tokens_mean": round(float(np.mean(list(map(len, prompts)))), 1),
                   "new_tokens": NEW_TOKENS, "temperature": 1.0}
            if "cadence" in args.sides:
                c = bench_engine(cfg, graphdef, params, prompts, pad_id, eos_id, forced, args.repeats, batch, bucket)
                row.update(cadence_tok_s=round(c["tok_s"], 1), cadence_s=round(c["seconds"], 2),
                           cadence_cpu_ms_per_tok=round(1000 * c["cpu_s"] / c["tokens"], 2),
                           cadence_compile_s=round(c["compile_s"], 1), cadence_tokens=c["tokens"],
                           cadence_steps=c["steps"], cadence_useful=round(c["tokens"] / (batch * c["steps"]), 3),
                           cadence_compilations=c["compilations"])
            if "transformers" in args.sides:
                best = None
                for threads in args.torch_threads:
                    t = bench_transformers(model, torch, prompts, pad_id, eos_id, forced, args.repeats, bucket, threads)
                    row[f"hf_tok_s_{threads}t"] = round(t["tok_s"], 1)
                    row[f"hf_cpu_ms_per_tok_{threads}t"] = round(1000 * t["cpu_s"] / t["tokens"], 2)
                    if best is None or t["tok_s"] > best["tok_s"]:
                        best = dict(t, threads=threads)
                row.update(hf_tok_s=round(best["tok_s"], 1), hf_s=round(best["seconds"], 2), hf_threads=best["threads"],
                           hf_tokens=best["tokens"], hf_steps=best["steps"],
                           hf_useful=round(best["tokens"] / (batch * best["steps"]), 3))
            if "cadence_tok_s" in row and "hf_tok_s" in row:
                row["ratio"] = round(row["cadence_tok_s"] / row["hf_tok_s"], 3)
                cpu_best = min(row[f"hf_cpu_ms_per_tok_{t}t"] for t in args.torch_threads)
                row["cpu_ratio"] = round(cpu_best / row["cadence_cpu_ms_per_tok"], 3)  # > 1: Cadence uses less CPU
            row.update(load_avg=round(os.getloadavg()[0], 1), cpus=os.cpu_count(), device=jax.devices()[0].platform)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
