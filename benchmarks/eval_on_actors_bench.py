"""Seconds per held-out evaluation: on the learner's own engine (run.eval_on=learner, the baseline)
vs as work for the actor processes (run.eval_on=actors), on the same small run; a learner on one
CPU device, and on 4 CPU devices with fsdp 4 (where the learner's evaluation first gathers the
whole model onto process 0). One JSON line.

    python benchmarks/eval_on_actors_bench.py [--steps 20 --eval-every 5 --heldout 64 --processes 2]

Each run is `cadence train` in a child process (sort-6, actors.processes=N). eval/seconds is the
wall time the learner waits for one evaluation (the actors' includes handing the chunks out, the
weights fetch and the wait for an actor to finish the engine call it is in); eval/generate_seconds
is the actors' engine time. Medians over the evaluations after step 0 (step 0 also compiles).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from cadence.launch.metrics import read_metrics  # noqa: E402


def run(eval_on: str, devices: int, args, work: str) -> dict:
    run_dir = os.path.join(work, f"{eval_on}-{devices}")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    if devices > 1:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={run_dir}",
                          f"run.steps={args.steps}", f"run.eval_every={args.eval_every}", f"run.eval_on={eval_on}",
                          f"actors.processes={args.processes}", "learner.sft.steps=30",
                          f"task.heldout_size={args.heldout}", "run.progress=false"],
                         capture_output=True, text=True, env=env, timeout=1200)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    evals = [m for m in read_metrics(run_dir) if "eval/seconds" in m]
    later = [m["eval/seconds"] for m in evals if m["step"] > 0]
    result = {"eval_seconds_median": round(statistics.median(later), 4), "eval_seconds_step0": round(evals[0]["eval/seconds"], 4),
              "evals": len(evals)}
    if eval_on == "actors":
        result["engine_seconds_median"] = round(statistics.median(
            m["eval/generate_seconds"] for m in evals if m["step"] > 0), 4)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--heldout", type=int, default=64)
    p.add_argument("--processes", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        out = {"bench": "eval_on_actors", "heldout": args.heldout, "actor_processes": args.processes}
        for devices in (1, 4):
            for eval_on in ("learner", "actors"):
                out[f"{eval_on}_{devices}dev"] = run(eval_on, devices, args, work)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
