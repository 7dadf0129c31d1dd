"""`cadence experiment NAME [--quick] [key=value ...]`: the experiments behind the controller.

    batch-invariance   fixed B x scaling rule x seeds: held-out score against cumulative samples
    throughput         generation samples/s vs concurrency, learner samples/s vs B, fitted curves
    decision-rule      predicted vs measured time-to-target per fixed B, and the controller on

Each writes a run folder: results.json, PNG plots, report.md and runs/<one per training run>.
"""
from __future__ import annotations

import datetime
import os

from cadence.launch.experiments import common

NAMES = ("batch-invariance", "throughput", "decision-rule")


def run_experiment(name: str, base, out: str | None = None, quick: bool = False, log=print, **opts) -> dict:
    """Run experiment `name` on the config `base` into folder `out` (default experiments/NAME-<time>)."""
    from cadence.launch.experiments import batch_invariance, decision_rule, throughput

    modules = {"batch-invariance": batch_invariance, "throughput": throughput, "decision-rule": decision_rule}
    if name not in modules:
        raise ValueError(f"unknown experiment {name!r}; expected one of {', '.join(NAMES)}")
    if out is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        out = os.path.join("experiments", f"{name}-{stamp}{'-quick' if quick else ''}")
    if os.path.exists(os.path.join(out, "results.json")):
        raise FileExistsError(f"{out} already holds an experiment (results.json); choose another --out")
    out = common.out_dir(out, name)
    results = modules[name].run(base, out, quick, log=log, **opts)
    results["out"] = out
    return results
