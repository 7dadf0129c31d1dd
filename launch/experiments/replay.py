"""The controller's decisions on a finished run's logged updates (`cadence replay RUN_DIR [key=value ...]`).

Each update's record in metrics.jsonl holds what the controller observed (the train step's gradient
norms, learner time, the actors' counters), so a controller built from the run's config, with any
`controller.*` overrides, can be fed the same observations offline: which decisions would this
version, or these settings, have made on this run? The answer holds while they agree with the
course the run took: at the first change the run did not make (or a change it made that the replay
does not), what followed would have differed, and the replay stops there and says so.
"""
from __future__ import annotations

import json
import os

from cadence.launch.config import load_config
from cadence.learner.controller import make_controller
from cadence.learner.controller.interface import Generation
from cadence.learner.loop import observation


def _records(path: str):
    with open(path) as f:
        for line in f:
            m = json.loads(line)
            if m.get("step") and "batch_size" in m:  # an update's record (evaluations have none)
                yield m


def replay(run_dir: str, overrides=()) -> dict:
    """{"decisions": [...], "stopped_at": step or None, "why": ...} for RUN_DIR (config.yaml and
    metrics.jsonl); overrides: key=value settings over the run's config (controller.enabled is
    set: the replay is of the measuring controller, whatever the run had).

    Raises:
      FileNotFoundError naming the missing file; ConfigError for a bad override.
    """
    for name in ("config.yaml", "metrics.jsonl"):
        if not os.path.isfile(os.path.join(run_dir, name)):
            raise FileNotFoundError(f"{os.path.join(run_dir, name)} not found: {run_dir} is not a finished run")
    cfg = load_config([os.path.join(run_dir, "config.yaml")], ["controller.enabled=true", *overrides])
    ctrl = make_controller(cfg.controller, cfg.learner, cfg.actors)  # enabled: the measuring one, as a run builds it
    stopped, why = None, None
    for m in _records(os.path.join(run_dir, "metrics.jsonl")):
        if m["batch_size"] != ctrl.batch_size:
            stopped, why = m["step"], f"the run trained B={m['batch_size']} here, the replayed course is B={ctrl.batch_size}"
            break
        gen = None
        if "actors/generate_seconds" in m:
            gen = Generation(m["wall_time"], m["actors/tokens_per_second"], m["actors/generate_seconds"],
                             m["actors/concurrency"])
        ctrl.update(observation(m["step"], m, gen))
    return {"run_dir": os.path.abspath(run_dir), "decisions": ctrl.decisions, "stopped_at": stopped, "why": why}
