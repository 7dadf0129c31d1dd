"""What a run leaves in its directory: config.yaml, command.txt, metrics.jsonl, params/, summary.json."""
from __future__ import annotations

import datetime
import os
import shlex
import sys

import orbax.checkpoint as ocp
import yaml

from launch import config_loader


def prepare_run_dir(cfg, run_dir: str | None = None) -> str:
    """Create the run directory and record the resolved config and the launch command."""
    run_dir = run_dir or cfg.run.dir
    if not run_dir:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        run_dir = os.path.join("runs", f"{cfg.task.name}-{stamp}")
    run_dir = os.path.abspath(run_dir)
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        raise FileExistsError(f"run directory {run_dir} already holds a run (metrics.jsonl); "
                              "choose another run.dir")
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(config_loader.to_dict(cfg), f, sort_keys=False)
    with open(os.path.join(run_dir, "command.txt"), "w") as f:
        f.write(" ".join(shlex.quote(a) for a in sys.argv) + "\n")
    return run_dir


def params_path(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), "params")


def save_params(run_dir: str, params) -> None:
    """Final policy weights as an orbax checkpoint (no pickle)."""
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(params_path(run_dir), params)


def load_params(run_dir: str, template):
    """Restore params saved by save_params into the structure of `template`."""
    path = params_path(run_dir)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist: the run did not finish or is not a Cadence run")
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, template)
