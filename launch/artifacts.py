"""What a run leaves in its directory: config.yaml, command.txt, metrics.jsonl, params/, summary.json."""
from __future__ import annotations

import datetime
import os
import re
import shlex
import sys

import yaml

from cadence.launch import config_loader

# Where a run's dispatcher says it listens (its actors and `cadence launch ray` read it back).
ENDPOINT_FILE = "endpoint.json"


def default_run_dir(cfg) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    # A plug-in's name may be a path or module:factory: keep a plain folder name.
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", cfg.task.name.rsplit("/", 1)[-1]).strip("-.") or "task"
    return os.path.join("runs", f"{name}-{stamp}")


def prepare_run_dir(cfg, run_dir: str, overwrite: bool = False) -> str:
    """Create the run directory and record the resolved config and the launch command.

    overwrite: allowed only for a run that never reached its first checkpoint (resume=auto)."""
    run_dir = os.path.abspath(run_dir)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    check_fresh(run_dir, overwrite)
    if os.path.exists(metrics):
        os.remove(metrics)
    os.makedirs(run_dir, exist_ok=True)
    write_config(cfg, run_dir)
    return run_dir


def check_fresh(run_dir: str, overwrite: bool = False) -> None:
    """Raises FileExistsError if run_dir holds a run that a new one would overwrite.

    overwrite: allowed only for a run that never reached its first checkpoint (resume=auto)."""
    if not overwrite and os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        raise FileExistsError(f"run directory {os.path.abspath(run_dir)} already holds a run (metrics.jsonl); "
                              "resume it with --resume or choose another run.dir")


def write_config(cfg, run_dir: str) -> None:
    """The resolved config and the command (appended: a resumed run adds its own line)."""
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(config_loader.to_dict(cfg), f, sort_keys=False)
    with open(os.path.join(run_dir, "command.txt"), "a") as f:
        f.write(" ".join(shlex.quote(a) for a in sys.argv) + "\n")


def params_path(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), "params")


def save_params(run_dir: str, params) -> None:
    """Final policy weights as an orbax checkpoint (no pickle)."""
    import orbax.checkpoint as ocp  # here, not at import: ~1 s off every start

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(params_path(run_dir), params, force=True)


def load_params(run_dir: str, template):
    """Restore params saved by save_params into the structure of `template`."""
    path = params_path(run_dir)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist: the run did not finish or is not a Cadence run")
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, template)


def params_digest(params, fetch=None) -> str:
    """SHA-256 over every param array's dtype, shape and bytes, in tree-path order: equal digests
    mean bitwise-equal params, however they were sharded. fetch(leaves) -> the leaves whole here:
    for params split over several processes (each joins, in the same order), one leaf at a time."""
    import hashlib

    import jax
    import numpy as np

    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        a = np.asarray(leaf if fetch is None else fetch([leaf])[0])
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
