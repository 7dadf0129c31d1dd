"""Shared pieces of the experiments: fixed-batch runs, time-to-target, the run folder (plots: launch/observe/plots.py).

Protocol (shared/notes/theory.md, "A"): held-out greedy evaluation at fixed SAMPLE intervals (the
same for every batch size), target = first evaluation at or above R*, read by linear interpolation
between the two evaluations around the crossing; report the median over seeds.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
from typing import Any

import numpy as np
import yaml

from cadence.launch import config_loader
from cadence.launch.config import Config
from cadence.launch.metrics import read_metrics
from cadence.learner.controller import BatchSizeController, holding_controller, scaled_learner

RunRecord = dict[str, Any]


def fixed_batch_config(base: Config, batch_size: int, scaling: str, seed: int, *, base_batch_size: int,
                       max_samples: int, eval_samples: int, run_dir: str, stop_at: float = 0.0,
                       smallest_batch_size: int | None = None) -> Config:
    """`base` at a fixed batch size with the scaling rule's Adam values (tuned at base_batch_size),
    stopped at controller.max_scaled_batch_size, as a controller would run that B.

    The microbatch size is the same for every batch size of an experiment and at most half the
    smallest one, so every run has >= 2 microbatches (the noise-scale estimator needs them).
    """
    lc = base.learner
    mb = max(1, min(lc.microbatch_size, (smallest_batch_size or batch_size) // 2))
    learner = dataclasses.replace(scaled_learner(lc, base_batch_size, batch_size, scaling,
                                                 base.controller.max_scaled_batch_size),
                                  batch_size=batch_size, microbatch_size=mb, seed=seed)
    run = dataclasses.replace(base.run, dir=run_dir, steps=max(1, max_samples // batch_size),
                              eval_every=max(1, eval_samples // batch_size), stop_at_exact_match=stop_at,
                              progress=False)
    return dataclasses.replace(base, learner=learner, run=run,
                               task=dataclasses.replace(base.task, seed=seed),
                               actors=dataclasses.replace(base.actors, seed=seed))


def train_or_reuse(cfg: Config, run_dir: str, controller, log=print) -> dict:
    """train(cfg, run_dir) unless run_dir already holds a finished run of the same config (its
    summary.json): an interrupted experiment, rerun into the same folder, redoes only what did
    not finish. An unfinished (or preempted) run's folder is cleared and trained again."""
    from cadence.launch.run.train import train

    summary_path = os.path.join(run_dir, "summary.json")
    config_path = os.path.join(run_dir, "config.yaml")
    summary = None
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
    if summary is not None and not summary.get("preempted", True) and os.path.isfile(config_path):
        # (a run stopped by SIGTERM leaves a summary too, with preempted true)
        with open(config_path) as f:
            saved = yaml.safe_load(f)
        try:  # keys added to the config since that run took their defaults there
            saved = config_loader.to_dict(config_loader.merge(Config(), saved))
        except config_loader.ConfigError:
            pass  # a key since removed: compared as is, so it differs
        saved = yaml.safe_load(yaml.safe_dump(saved, sort_keys=False))
        wanted = yaml.safe_load(yaml.safe_dump(config_loader.to_dict(cfg), sort_keys=False))
        for c in (saved, wanted):
            c.get("run", {}).pop("dir", None)  # the folder may have been moved or copied
        if saved == wanted:
            log(f"  reusing the finished run {run_dir}")
            return summary
        raise FileExistsError(f"{run_dir} holds a finished run of another config; choose another --out")
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)
    return train(cfg, run_dir, controller=controller)


def observer(cfg: Config) -> BatchSizeController:
    """A controller that never changes B but logs the noise scale and throughput estimates; no
    initial rescaling (fixed_batch_config already holds the rule's Adam values)."""
    return holding_controller(dataclasses.replace(cfg.controller, base_batch_size=0), cfg.learner, cfg.actors)


def run_record(cfg: Config, run_dir: str, metric: str, **labels) -> RunRecord:
    """What one finished run contributes: its eval curve and measurements, from metrics.jsonl."""
    rows = read_metrics(run_dir)
    t0 = rows[0]["wall_time"]  # RL starts after build, warm-up and the first evaluation
    evals = [(r["samples"], r["wall_time"] - t0 if r["step"] else 0.0, r[metric])
             for r in rows if r.get(metric) is not None]
    steps = [r for r in rows if r["step"] > 0]
    bn = [r["controller/noise_scale"] for r in steps if r.get("controller/noise_scale")]
    k = min(2, len(steps) - 1)  # skip the first updates (compilation) when measuring throughput
    rl_wall = steps[-1]["wall_time"] - steps[k]["wall_time"] if k > 0 else 0.0
    train_s = [r["learner/train_seconds"] for r in steps[2:]] or [r["learner/train_seconds"] for r in steps]
    return {**labels, "run_dir": run_dir, "metric": metric, "curve": evals,
            "batch_sizes": [r["batch_size"] for r in steps],
            "decisions": [(r["step"], r["controller/decision"]) for r in steps if r.get("controller/decision")],
            "noise_scale": float(np.median(bn[len(bn) // 2:])) if bn else None,
            "samples_per_second": (steps[-1]["samples"] - steps[k]["samples"]) / rl_wall if rl_wall > 0 else None,
            "learner_seconds_per_step": float(np.median(train_s)) if train_s else None,
            "lr": cfg.learner.optimizer.lr, "b1": cfg.learner.optimizer.b1,
            "b2": cfg.learner.optimizer.b2, "eps": cfg.learner.optimizer.eps}


def crossing(curve, target: float) -> tuple[float, float] | None:
    """(samples, wall seconds) where the eval curve first reaches `target`, interpolated; None if never."""
    prev = None
    for s, w, v in curve:
        if v >= target:
            if prev is None or prev[2] >= target:
                return float(s), float(w)
            f = (target - prev[2]) / (v - prev[2])
            return prev[0] + f * (s - prev[0]), prev[1] + f * (w - prev[1])
        prev = (s, w, v)
    return None


def auto_target(records: list[RunRecord], fraction: float = 0.5) -> float:
    """start + fraction * (median best-reached - start): most runs reach it, a run that never
    improves does not (the median keeps one flat run from making the target the start)."""
    start = statistics.median(r["curve"][0][2] for r in records)
    best = statistics.median(max(v for _, _, v in r["curve"]) for r in records)
    return start + fraction * (best - start)


def add_time_to_target(records: list[RunRecord], target: float) -> None:
    for r in records:
        hit = crossing(r["curve"], target)
        r["samples_to_target"], r["wall_to_target"] = hit if hit else (None, None)


def median_to_target(runs: list[RunRecord], key: str) -> tuple[float | None, bool]:
    """Median over seeds of `key` ("samples_to_target" or "wall_to_target"), and whether it is one.

    A run that never reached the target counts as slower than every run that did (dropping it
    would flatter a batch size that mostly fails); its budget at the last evaluation is a lower
    bound on its time. When the median falls on such a run, (that lower bound, False) is returned.
    """
    at = {"samples_to_target": 0, "wall_to_target": 1}[key]
    ranked = sorted((r[key] is None, r[key] if r[key] is not None else _budget(r, at)) for r in runs)
    if not ranked:
        return None, False
    n = len(ranked)
    middle = ranked[(n - 1) // 2: n // 2 + 1]
    return float(statistics.mean(v for _, v in middle)), not any(censored for censored, _ in middle)


def seeds_reached(runs: list[RunRecord]) -> str:
    """"k/n": how many of the runs reached the target."""
    return f"{sum(r['samples_to_target'] is not None for r in runs)}/{len(runs)}"


def _budget(run: RunRecord, at: int) -> float:
    """Samples (at=0) or wall seconds (at=1) at the run's last evaluation; 0 if it has none."""
    return float(run["curve"][-1][at]) if run["curve"] else 0.0


def median_or_none(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def relative_spread(values) -> float | None:
    """(max - min) / mean of the values, None if fewer than two."""
    vals = [v for v in values if v is not None]
    if len(vals) < 2:
        return None
    return (max(vals) - min(vals)) / float(np.mean(vals))


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=float)


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def out_dir(base: str, name: str) -> str:
    path = os.path.abspath(base)
    os.makedirs(os.path.join(path, "runs"), exist_ok=True)
    return path
