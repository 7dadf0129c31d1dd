"""Startup: seconds from the `cadence train` command to its first RL step, cold and warm.

Runs, each a fresh process of the default `cadence train` (stopped after --steps updates):
  off     run.jax_cache=none: every program compiled (what every run paid before the cache)
  cold    an empty persistent compilation cache (compiles and writes it)
  warm    the same cache again (the second run of a user: programs loaded from disk)
and two bare baselines of the same machine: a process that imports JAX and runs one op, and one
that imports Cadence's training module. "first step" is when metrics.jsonl gets its step-1 row
(polled every 10 ms), measured from the moment the command is started; "train() start" is that
minus the row's own wall_time (the run's clock starts inside train()). Prints one JSON line.

    python benchmarks/startup_bench.py [--steps 2] [--repeats 1] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("JAX_ENABLE_COMPILATION_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def process_seconds(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), cwd=ROOT)
    return time.perf_counter() - t0


def first_step(run_dir: str, cache: str, steps: int, extra: list[str]) -> dict:
    args = [sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={run_dir}", f"run.steps={steps}",
            "run.eval_every=0", "run.progress=false", f"run.jax_cache={cache}", *extra]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, row = None, None
    while proc.poll() is None and seen is None:
        if os.path.exists(metrics):
            with open(metrics) as f:
                rows = [json.loads(line) for line in f if line.strip().endswith("}")]
            row = next((r for r in rows if r["step"] >= 1), None)
            if row is not None:
                seen = time.perf_counter() - t0
                break
        time.sleep(0.01)
    out, err = proc.communicate()
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"cadence train failed:\n{err[-3000:]}")
    rows = [json.loads(line) for line in open(metrics)]
    row0 = rows[0]
    row = row or rows[1]
    seen = seen if seen is not None else total
    return {"first_step_seconds": seen, "process_seconds": total,
            "train_start_seconds": seen - row["wall_time"],  # imports + config, before train()
            "to_rl_seconds": row0["wall_time"],  # inside train(): build, warm-up, first eval
            "first_step_wall_time": row["wall_time"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="cold/warm pairs (median reported)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every run")
    a = ap.parse_args()
    bare_jax = process_seconds("import jax, jax.numpy as jnp; jnp.zeros(1).block_until_ready()")
    bare_import = process_seconds("import cadence.launch.run.train")
    runs: dict[str, list[dict]] = {"off": [], "cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as work:
        for i in range(a.repeats):
            cache = os.path.join(work, f"cache{i}")
            runs["off"].append(first_step(os.path.join(work, f"off{i}"), "none", a.steps, a.set))
            runs["cold"].append(first_step(os.path.join(work, f"cold{i}"), cache, a.steps, a.set))
            runs["warm"].append(first_step(os.path.join(work, f"warm{i}"), cache, a.steps, a.set))
    med = {k: {m: round(statistics.median(r[m] for r in v), 2) for m in v[0]} for k, v in runs.items()}
    print(json.dumps({
        "bench": "startup", "steps": a.steps, "overrides": a.set,
        "warm_first_step_seconds": med["warm"]["first_step_seconds"],
        "cold_first_step_seconds": med["cold"]["first_step_seconds"],
        "off_first_step_seconds": med["off"]["first_step_seconds"],
        "bare_jax_process_seconds": round(bare_jax, 2), "bare_import_seconds": round(bare_import, 2),
        "warm_over_bare_jax": round(med["warm"]["first_step_seconds"] / bare_jax, 2),
        "phases": med,
    }))


if __name__ == "__main__":
    main()
