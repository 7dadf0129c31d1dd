"""Resuming a run: which config changes are allowed, and putting the run directory back in order.

A resume continues from the newest complete checkpoint. Keys that change what the checkpoint
means (the model's shape, the task's prompt stream, the group layout) must be unchanged; anything
else (steps, eval cadence, learning rate, staleness bound, number of actors) may change.
"""
from __future__ import annotations

import json
import os

from launch.config_loader import ConfigError, load_yaml

# Dotted prefixes that a resumed run must share with the run it continues.
FROZEN_PREFIXES = ("model.", "task.", "learner.group_size", "learner.seed", "engine.max_new_tokens")


class RunFinished(RuntimeError):
    """The run directory holds a finished run: resuming would train zero steps."""


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def incompatible_keys(saved: dict, current: dict) -> list[str]:
    """Frozen keys whose values differ between the saved config and the current one."""
    a, b = _flatten(saved), _flatten(current)
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k.startswith(FROZEN_PREFIXES) and a.get(k) != b.get(k)]


def check_compatible(run_dir: str, saved_cfg: dict, current_cfg: dict) -> None:
    bad = incompatible_keys(saved_cfg, current_cfg)
    if bad:
        pairs = "; ".join(f"{k}: {_flatten(saved_cfg).get(k)!r} -> {_flatten(current_cfg).get(k)!r}" for k in bad)
        raise ConfigError(f"cannot resume {run_dir} with a changed {', '.join(bad)} ({pairs}); "
                          "start a new run.dir instead")


def saved_config(run_dir: str) -> dict:
    return load_yaml(os.path.join(run_dir, "config.yaml"))


def truncate_metrics(path: str, last_step: int) -> int:
    """Keep metrics lines up to and including `last_step` (the checkpoint's); drop the rest,
    including a half-written last line. Returns the number of lines kept."""
    if not os.path.exists(path):
        return 0
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by the crash
            if row.get("step", 0) > last_step:
                break
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(kept)
