"""Time-to-target: wall seconds and samples until held-out greedy exact match >= 0.5 on sort-6.

Each run is a fresh `cadence train` process (compilation included, cold caches), stopped at the
first evaluation that reaches the target. Setups, in one invocation:
  default        the defaults (asynchronous, max_staleness=1)
  default-sync   the same with actors.max_staleness=0 (synchronous, on-policy)
  default-inline the default with rewards scored inline in the actor thread (task.reward_workers=0)
                 instead of the worker pool: what the pool costs the default run
  reference      benchmarks/configs/reference.yaml: the setup the brief quoted a PyTorch GRPO
                 trainer for (135k-param Llama, 30 warm-up steps, 16 prompts x 8, Adam 3e-4, no KL)
  processes-1    the default with actors.processes=1 (the actor in its own process, over ZeroMQ)
  processes-2    the default with actors.processes=2 (two actor processes)
Prints one JSON line per setup (median over seeds) and a final comparison line.

    python benchmarks/time_to_target.py [--seeds 0 1 2] [--setups default default-sync reference]
    python benchmarks/time_to_target.py --setups default default-sync --lr default-sync=2e-3
    python benchmarks/time_to_target.py --setups default-sync --sweep-lr 5e-4 1e-3 2e-3

--lr SETUP=LR runs a setup at its own learning rate (each side tuned on its own: async/sync is
then best against best); --sweep-lr runs every setup at every listed lr, one line per (setup, lr),
and compares the best of each side (fewest median samples among the lrs that reached the target
in every seed; wall-clock needs a quiet machine, samples do not).
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
SETUPS = {
    "default": [],
    "default-sync": ["actors.max_staleness=0"],
    "default-inline": ["task.reward_workers=0"],
    "reference": ["--config", os.path.join(HERE, "configs", "reference.yaml")],
    "processes-1": ["actors.processes=1"],  # the default with its actor in a process of its own
    "processes-2": ["actors.processes=2"],
}


def run_once(setup: str, seed: int, max_steps: int, workdir: str, lr: float | None = None) -> dict:
    run_dir = os.path.join(workdir, f"{setup}-{seed}" + (f"-lr{lr:g}" if lr else ""))
    args = list(SETUPS[setup]) + ([f"learner.optimizer.lr={lr}"] if lr else []) + [
        f"run.dir={run_dir}", f"run.steps={max_steps}", f"run.stop_at_exact_match={TARGET}",
        "run.progress=false", f"learner.seed={seed}", f"actors.seed={seed}", f"task.seed={seed}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               JAX_ENABLE_COMPILATION_CACHE="false")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", *args], capture_output=True,
                         text=True, env=env, cwd=ROOT)
    process_seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{setup} seed {seed} failed:\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if r["step"] > 0]
    rl_start = rows[0]["wall_time"]
    rl_wall = steps[-1]["wall_time"] - rl_start
    wait = sum(r["learner/wait_seconds"] for r in steps)
    gen = steps[-1].get("actors/generate_seconds") or 0.0
    adm = steps[-1].get("actors/admission_wait_seconds")  # measured for actor threads only
    hit = summary["target_reached_at"]
    return {
        "seed": seed,
        "reached": hit is not None,
        "wall_seconds": hit["wall_time"] if hit else None,       # since train() started
        "process_seconds": process_seconds if hit else None,      # incl. Python/JAX import
        "samples": hit["samples"] if hit else None,
        "steps": hit["step"] if hit else None,
        "startup_seconds": rl_start,                              # build, warm-up, first eval
        "samples_per_second": steps[-1]["samples"] / max(rl_wall, 1e-9),
        "learner_idle_fraction": wait / max(rl_wall, 1e-9),      # learner blocked on samples
        "actor_busy_fraction": gen / max(rl_wall, 1e-9),          # actor inside engine calls
        "actor_admission_wait_fraction": None if adm is None else adm / max(rl_wall, 1e-9),  # blocked by the bound
        "final_exact_match": summary["final_eval"]["eval/exact_match"],
    }


def median(runs, key):
    vals = [r[key] for r in runs if r[key] is not None]
    return statistics.median(vals) if vals else None


def _best(lines: list[dict]) -> dict:
    """The lr that reached the target in every seed with the fewest median samples (else the most
    seeds reached, then the fewest samples)."""
    return min(lines, key=lambda l: (-l["reached"], l["samples"] if l["samples"] is not None else 1e18))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--setups", nargs="+", default=["default", "default-sync", "reference"], choices=list(SETUPS))
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--lr", nargs="+", default=[], metavar="SETUP=LR",
                   help="a setup's own learning rate, e.g. default-sync=2e-3")
    p.add_argument("--sweep-lr", nargs="+", type=float, default=[], metavar="LR",
                   help="run every setup at each of these learning rates")
    a = p.parse_args()
    own_lr = {k: float(v) for k, v in (x.split("=", 1) for x in a.lr)}
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as work:
        # Seeds outer, setups (and lrs) inner: on a shared machine, load changes over minutes hit
        # every setup alike instead of whichever ran last.
        cells = [(setup, lr) for setup in a.setups for lr in (a.sweep_lr or [own_lr.get(setup)])]
        by_cell: dict[tuple, list[dict]] = {cell: [] for cell in cells}
        for s in a.seeds:
            for setup, lr in cells:
                by_cell[(setup, lr)].append(run_once(setup, s, a.max_steps, work, lr))
        for (setup, lr), runs in by_cell.items():
            line = {"bench": "time_to_target", "setup": setup, "lr": lr, "target_exact_match": TARGET,
                    "seeds": a.seeds, "reached": sum(r["reached"] for r in runs)}
            for key in ("wall_seconds", "process_seconds", "samples", "steps", "startup_seconds",
                        "samples_per_second", "learner_idle_fraction", "actor_busy_fraction",
                        "actor_admission_wait_fraction"):
                line[key] = median(runs, key)
            line["runs"] = runs
            results.setdefault(setup, []).append(line)
            print(json.dumps(line), flush=True)
    if "default" in results and "default-inline" in results:
        d, i = _best(results["default"]), _best(results["default-inline"])
        print(json.dumps({"bench": "reward_pool_vs_inline", "pool_wall_seconds": d["wall_seconds"],
                          "inline_wall_seconds": i["wall_seconds"],
                          "time_ratio": (d["wall_seconds"] / i["wall_seconds"])
                          if d["wall_seconds"] and i["wall_seconds"] else None,
                          "pool_samples": d["samples"], "inline_samples": i["samples"]}))
    if "default" in results and "default-sync" in results:
        d, s = _best(results["default"]), _best(results["default-sync"])
        ratio = (d["wall_seconds"] / s["wall_seconds"]) if d["wall_seconds"] and s["wall_seconds"] else None
        samples = (d["samples"] / s["samples"]) if d["samples"] and s["samples"] else None
        print(json.dumps({"bench": "async_vs_sync", "async_lr": d["lr"], "sync_lr": s["lr"],
                          "async_wall_seconds": d["wall_seconds"],
                          "sync_wall_seconds": s["wall_seconds"], "time_ratio": ratio,
                          "async_samples": d["samples"], "sync_samples": s["samples"],
                          "samples_ratio": samples,
                          "async_samples_per_second": d["samples_per_second"],
                          "sync_samples_per_second": s["samples_per_second"],
                          "throughput_ratio": d["samples_per_second"] / s["samples_per_second"]}))


if __name__ == "__main__":
    main()
