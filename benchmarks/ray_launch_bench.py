"""Time-to-target under Ray vs the same run without Ray, and the time from launch to the first step.

Both setups train sort-6 to held-out exact match 0.5 with one learner process and one actor
process over ZeroMQ: `cadence train actors.processes=1` (the actor started by the learner's own
supervisor; time_to_target's processes-1 setup) and `cadence launch ray actors.processes=1` on a
two-node Ray cluster on loopback (the learner on the head, the actor on the worker node). Seeds
alternate between the setups, so load on a shared machine falls on both alike. Runs inside a
private network namespace (root): Ray listens on all interfaces.

    python benchmarks/ray_launch_bench.py [--seeds 0 1 2]

Prints one JSON line per setup and a comparison line: ratio = Ray / bare of the median
time-to-target on the learner's clock (goal <= 1.15), and the median seconds from
`cadence launch ray` to the first training step (Ray placement, process start, warm-up, compile).
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
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from cadence.launch.cluster.launch_state import last_metrics  # noqa: E402
from cadence.launch.cluster.ray.local_cluster import HEAD_RESOURCE, WORKER_RESOURCE, LocalCluster, enter_private_network  # noqa: E402
from time_to_target import TARGET, run_once  # noqa: E402


def run_ray(address: str, seed: int, max_steps: int, workdir: str) -> dict:
    run_dir = os.path.join(workdir, f"ray-{seed}")
    args = ["actors.processes=1", f"launch.learner_resources=[{HEAD_RESOURCE}=0.1]",
            f"launch.actor_resources=[{WORKER_RESOURCE}=0.1]", f"run.dir={run_dir}", f"run.steps={max_steps}",
            f"run.stop_at_exact_match={TARGET}", "run.progress=false", f"learner.seed={seed}",
            f"actors.seed={seed}", f"task.seed={seed}"]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_ENABLE_COMPILATION_CACHE="false")
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "cadence.launch.cli", "launch", "ray", "--address", address, *args],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
        first_step = None
        while proc.poll() is None and first_step is None:  # the command's start -> the first update's metrics line
            if last_metrics(run_dir).get("step", 0) >= 1:
                first_step = time.perf_counter() - t0
            time.sleep(0.2)
        out, _ = proc.communicate()
        process_seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"ray seed {seed} failed:\n{err.read()[-3000:]}")
    summary = json.loads(out.strip().splitlines()[-1])
    hit = summary["target_reached_at"]
    return {"seed": seed, "reached": hit is not None, "wall_seconds": hit["wall_time"] if hit else None,
            "process_seconds": process_seconds if hit else None, "samples": hit["samples"] if hit else None,
            "first_step_seconds": first_step, "driver_first_step_seconds": summary["launch"]["first_step_seconds"],
            "final_exact_match": summary["final_eval"]["eval/exact_match"]}


def median(runs, key):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--max-steps", type=int, default=1500)
    a = p.parse_args()
    enter_private_network()
    runs = {"ray": [], "bare": []}
    t0 = time.perf_counter()
    with LocalCluster(cpus=2) as cluster, tempfile.TemporaryDirectory() as work:
        cluster_seconds = time.perf_counter() - t0
        for seed in a.seeds:
            runs["ray"].append(run_ray(cluster.address, seed, a.max_steps, work))
            runs["bare"].append(run_once("processes-1", seed, a.max_steps, work))
    keys = ("wall_seconds", "process_seconds", "samples", "first_step_seconds")
    for name, rs in runs.items():
        line = {"bench": "ray_launch", "setup": name, "seeds": a.seeds, "reached": sum(r["reached"] for r in rs),
                **{k: median(rs, k) for k in keys}, "runs": rs}
        print(json.dumps(line), flush=True)
    r, b = median(runs["ray"], "wall_seconds"), median(runs["bare"], "wall_seconds")
    rp, bp = median(runs["ray"], "process_seconds"), median(runs["bare"], "process_seconds")
    print(json.dumps({"bench": "ray_vs_bare", "ray_wall_seconds": r, "bare_wall_seconds": b,
                      "time_ratio": r / b if r and b else None,
                      "process_ratio": rp / bp if rp and bp else None,
                      "launch_to_first_step_seconds": median(runs["ray"], "first_step_seconds"),
                      "cluster_start_seconds": round(cluster_seconds, 1), "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
