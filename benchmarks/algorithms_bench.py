"""Algorithms on sort-6: time-to-target per algorithm, and the staleness-tolerance table.

Each run is a fresh `cadence train` process stopped at the first evaluation with held-out greedy
exact match >= 0.5 (or at --max-steps). Two tables, in one invocation:

  algorithms   GRPO, Dr.GRPO, DAPO, PPO (presets of docs/algorithms.md) at the default staleness
  staleness    actors.max_staleness in 0 1 2 4 8, with the coupled (default), decoupled (1 and 4 updates per batch)
               corrections and without one (grpo.correction=none): time-to-target, and peak vs final
               training reward (a collapse shows as a final well below the peak)

Prints one JSON line per run and a markdown table per part (paste into README).

    python benchmarks/algorithms_bench.py [--part algorithms staleness] [--seeds 0] [--max-steps 400] [--set KEY=VALUE ...]
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
TARGET = 0.5
ALGORITHMS = {
    "GRPO": ["learner.grpo.aggregation=seq_mean_token_mean"],
    "Dr.GRPO": ["learner.grpo.scale_by_std=false", "learner.grpo.aggregation=seq_sum_norm",
                "learner.grpo.aggregation_constant=8"],
    "DAPO": ["learner.grpo.clip_high=0.28", "learner.grpo.aggregation=token_mean",
             "learner.grpo.dynamic_sampling=true"],
    "PPO": ["learner.algorithm=ppo"],
}
STALENESS = (0, 1, 2, 4, 8)
CORRECTIONS = {"coupled": ["learner.grpo.correction=coupled"],  # the default
               "decoupled": ["learner.grpo.correction=decoupled"],
               # 4 updates per batch: the proximal policy (batch start) differs from the updated one
               "decoupled-4mb": ["learner.grpo.correction=decoupled", "learner.minibatches=4"],
               "uncorrected": ["learner.grpo.correction=none"]}


def run_once(name: str, overrides: list[str], seed: int, max_steps: int, workdir: str) -> dict:
    run_dir = os.path.join(workdir, f"{name}-{seed}".replace(" ", "_").replace("=", "-"))
    args = overrides + [f"run.dir={run_dir}", f"run.steps={max_steps}",
                        f"run.stop_at_exact_match={TARGET}", "run.progress=false",
                        f"learner.seed={seed}", f"actors.seed={seed}", f"task.seed={seed}"]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_ENABLE_COMPILATION_CACHE="false")
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", *args], capture_output=True,
                         text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if r["step"] > 0]
    hit = summary["target_reached_at"]
    tail = steps[-10:]
    return {
        "setup": name, "seed": seed, "reached": hit is not None,
        "wall_seconds": hit["wall_time"] if hit else None,
        "samples": hit["samples"] if hit else None,
        "steps": len(steps),
        "final_reward": statistics.mean(r["reward/mean"] for r in tail),
        # best 10-update mean: a run that collapsed shows peak_reward well above final_reward
        "peak_reward": max(statistics.mean(r["reward/mean"] for r in steps[i:i + 10])
                           for i in range(max(1, len(steps) - 9))),
        "final_exact_match": summary["final_eval"]["eval/exact_match"],
        "ess_min": min(r.get("ess", 1.0) for r in steps),
        "mismatch_kl_max": max(r.get("mismatch_kl", 0.0) for r in steps),
        "dropped": {k: v for k, v in steps[-1].items() if k.startswith("dropped")},
        # the share of tokens the dual clip silenced, and top-p's KL(truncated || full) per token
        "dual_clip_frac_mean": statistics.mean(r.get("dual_clip_frac", 0.0) for r in steps),
        "truncation_kl_mean": (statistics.mean(r["truncation_kl"] for r in steps)
                               if "truncation_kl" in steps[-1] else None),
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(name: str, runs: list[dict]) -> dict:
    return {"setup": name, "reached": f"{sum(r['reached'] for r in runs)}/{len(runs)}",
            "wall_seconds": _median([r["wall_seconds"] for r in runs]),
            "samples": _median([r["samples"] for r in runs]),
            "final_reward": _median([r["final_reward"] for r in runs]),
            "peak_reward": _median([r["peak_reward"] for r in runs]),
            "final_exact_match": _median([r["final_exact_match"] for r in runs])}


def _fmt(v):
    return "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))


def table(rows: list[dict]) -> str:
    keys = ["setup", "reached", "wall_seconds", "samples", "peak_reward", "final_reward", "final_exact_match"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", nargs="+", default=["algorithms", "staleness"],
                    choices=["algorithms", "staleness"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--staleness", nargs="+", type=int, default=list(STALENESS))
    ap.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run (e.g. learner.optimizer.lr=2.5e-4)")
    args = ap.parse_args()
    setups: list[tuple[str, str, list[str]]] = []
    if "algorithms" in args.part:
        setups += [("algorithms", name, ov) for name, ov in ALGORITHMS.items()]
    if "staleness" in args.part:
        setups += [("staleness", f"{corr} s={s}", ov + [f"actors.max_staleness={s}"])
                   for s in args.staleness for corr, ov in CORRECTIONS.items() if corr in args.corrections]
    summaries: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        for part, name, overrides in setups:
            runs = []
            for seed in args.seeds:
                r = run_once(name, overrides + args.set, seed, args.max_steps, workdir)
                print(json.dumps(r), flush=True)
                runs.append(r)
            summaries.setdefault(part, []).append(summarize(name, runs))
    for part, rows in summaries.items():
        print(f"\n## {part} (target held-out exact match >= {TARGET}, median over seeds "
              f"{args.seeds}{', with ' + ' '.join(args.set) if args.set else ''}, "
              f"{time.perf_counter() - t0:.0f} s total)\n{table(rows)}")


if __name__ == "__main__":
    main()
