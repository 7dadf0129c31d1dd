"""Overhead of watching a run: the default `cadence train` with every metric sink on vs jsonl only.

"all sinks": run.loggers=[jsonl,tensorboard,wandb] (W&B offline: WANDB_MODE=offline) and
run.prometheus_port, with /metrics scraped every second while the run trains. Baseline: the same
run with metrics.jsonl only (the default). Both are time_to_target.py's measurement (a fresh
process per run, wall seconds until held-out exact match >= 0.5, compilation included), seeds
interleaved (jsonl, all, jsonl, all, ...) so a change in machine load hits both alike. Also the
CPU seconds each training process (and the children it waited for) used until it exited: on a
shared machine wall time swings with other jobs, CPU time much less.
Prints one JSON line: medians over seeds and their ratios (goal: time-to-target ratio <= 1.05).

    python benchmarks/sinks_bench.py [--seeds 0 1 2] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import time_to_target  # noqa: E402  (benchmarks/ is not a package)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scraper(port: int, stop: threading.Event) -> None:
    """A Prometheus server's part: GET /metrics every second while the run is up."""
    while not stop.wait(1.0):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
        except OSError:
            pass  # not up yet, or already gone


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--keep", default=None, help="keep the run directories here (e.g. for cadence report)")
    a = p.parse_args()
    port = free_port()
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    time_to_target.SETUPS["jsonl-only"] = []
    time_to_target.SETUPS["all-sinks"] = ["run.loggers=[jsonl,tensorboard,wandb]", f"run.prometheus_port={port}"]
    runs = {"jsonl-only": [], "all-sinks": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.abspath(a.keep) if a.keep else tmp
        os.makedirs(work, exist_ok=True)
        for seed in a.seeds:
            for setup in runs:
                stop = threading.Event()
                watch = threading.Thread(target=scraper, args=(port, stop), daemon=True)
                if setup == "all-sinks":
                    watch.start()
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                try:
                    r = time_to_target.run_once(setup, seed, a.max_steps, work)
                finally:
                    stop.set()
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                r["cpu_seconds"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                runs[setup].append(r)
    line = {"bench": "sinks_overhead", "target_exact_match": time_to_target.TARGET, "seeds": a.seeds}
    for setup, rs in runs.items():
        tag = setup.replace("-", "_")
        line[f"{tag}_reached"] = sum(r["reached"] for r in rs)
        for key in ("wall_seconds", "samples", "samples_per_second", "cpu_seconds"):
            line[f"{tag}_{key}"] = time_to_target.median(rs, key)
    j, s = line["jsonl_only_wall_seconds"], line["all_sinks_wall_seconds"]
    line["time_to_target_ratio"] = s / j if j and s else None
    line["cpu_seconds_ratio"] = line["all_sinks_cpu_seconds"] / line["jsonl_only_cpu_seconds"]
    line["samples_per_second_ratio"] = line["all_sinks_samples_per_second"] / line["jsonl_only_samples_per_second"]
    line["per_seed_time_ratio"] = [b["wall_seconds"] / a_["wall_seconds"] if a_["reached"] and b["reached"] else None
                                   for a_, b in zip(runs["jsonl-only"], runs["all-sinks"])]
    line["runs"] = runs
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
