"""Engine speed: generated tokens/s of JaxEngine.generate vs a bare jitted decode loop.

Setup: the default ModelConfig (~127k params), batch 128, 8-token prompts, 8 new tokens, sampling
at temperature 1 (top_p 1), EOS disabled so both sides produce every token.
Baseline: one jitted function doing prefill + a plain ``fori_loop`` of ``decode_step`` with
``jax.random.categorical`` (same model, same batch, same cache, no bucketing, no host work beyond
``block_until_ready``). Ours: the full ``generate`` call (host packing, bucketing, the jitted
while-loop with top-p/greedy branches and EOS bookkeeping, transfer back to NumPy).
Both after warm-up; each figure is the median over repeats. Prints one JSON line.
Run: `.venv/bin/python benchmarks/engine_bench.py [--repeats 15] [--inner 5]`.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_timing import median_seconds  # noqa: E402  (benchmarks/ is the script's own dir)

from cadence.actors.engine import EngineConfig, JaxEngine  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402

BATCH, PROMPT_LEN, NEW_TOKENS = 128, 8, 8


def bare_loop(graphdef, cfg: ModelConfig, params, tokens, rng):
    """Prefill + fori_loop of decode steps with categorical sampling: the floor to compare against."""
    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cache = llama.init_cache(cfg, b, p + NEW_TOKENS - 1)
    logits, cache = llama.prefill(graphdef, params, cache, tokens, positions, jnp.ones((b, p), bool))
    tok = jax.random.categorical(jax.random.fold_in(rng, 0), logits).astype(jnp.int32)
    out = jnp.zeros((b, NEW_TOKENS), jnp.int32).at[:, 0].set(tok)

    def body(i, carry):
        cache, tok, out = carry
        logits, cache = llama.decode_step(graphdef, params, cache, tok, jnp.full((b,), p - 1, jnp.int32) + i)
        tok = jax.random.categorical(jax.random.fold_in(rng, i), logits).astype(jnp.int32)
        return cache, tok, out.at[:, i].set(tok)

    return jax.lax.fori_loop(1, NEW_TOKENS, body, (cache, tok, out))[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed samples per side")
    parser.add_argument("--inner", type=int, default=5, help="calls per timed sample")
    args = parser.parse_args()

    cfg = ModelConfig()
    graphdef, params = llama.init_params(cfg, 0)
    rng = jax.random.key(0)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, PROMPT_LEN)).astype(np.int32)
    num_tokens = BATCH * NEW_TOKENS

    bare = jax.jit(functools.partial(bare_loop, graphdef, cfg))
    device_prompts = jnp.asarray(prompts)
    bare_s = median_seconds(lambda: bare(params, device_prompts, rng).block_until_ready(), args.repeats, args.inner)

    engine = JaxEngine(cfg, graphdef, EngineConfig(max_new_tokens=NEW_TOKENS), eos_id=cfg.vocab_size, pad_id=0)
    prompt_lists = prompts.tolist()
    result = engine.generate(params, prompt_lists, rng)
    assert result.num_tokens == num_tokens, "EOS is disabled: every row must produce every token"
    engine_s = median_seconds(lambda: engine.generate(params, prompt_lists, rng), args.repeats, args.inner)
    greedy_s = median_seconds(lambda: engine.generate(params, prompt_lists, rng, greedy=True), args.repeats, args.inner)
    top_p_s = median_seconds(lambda: engine.generate(params, prompt_lists, rng, top_p=0.9), args.repeats, args.inner)

    print(
        json.dumps(
            {
                "bench": "engine",
                "engine_tok_s": round(num_tokens / engine_s, 1),
                "bare_tok_s": round(num_tokens / bare_s, 1),
                "ratio": round(bare_s / engine_s, 3),
                "engine_greedy_tok_s": round(num_tokens / greedy_s, 1),
                "engine_top_p_0.9_tok_s": round(num_tokens / top_p_s, 1),
                "batch": BATCH,
                "prompt_len": PROMPT_LEN,
                "new_tokens": NEW_TOKENS,
                "params": llama.count_params(params),
                "compilations": engine.num_compilations,
                "device": str(jax.devices()[0].platform),
            }
        )
    )


if __name__ == "__main__":
    main()
