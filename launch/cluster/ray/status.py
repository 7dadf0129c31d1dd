"""What `cadence launch ray` leaves in RUN_DIR/launch/, and the two commands that read it.

    cadence launch ray --status RUN_DIR   # processes, nodes, restarts, step, samples (JSON)
    cadence launch ray --stop RUN_DIR     # ask the driver to stop: final checkpoint, actors leave

The driver rewrites RUN_DIR/launch/status.json about once a second and polls RUN_DIR/launch/stop;
a stop is a file (not a signal) so it works from any machine that sees the run directory. No Ray
here: reading a status needs no cluster connection.
"""
from __future__ import annotations

import json
import os
import time

LAUNCH_DIR = "launch"
STATUS_FILE = "status.json"
STOP_FILE = "stop"


def launch_dir(run_dir: str) -> str:
    return os.path.join(run_dir, LAUNCH_DIR)


def write_status(run_dir: str, status: dict) -> None:
    path = os.path.join(launch_dir(run_dir), STATUS_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(status, f, indent=1)
    os.replace(tmp, path)  # a reader never sees half a file


def read_status(run_dir: str) -> dict:
    """The driver's last status, with the newest step and samples from metrics.jsonl."""
    path = os.path.join(launch_dir(run_dir), STATUS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {run_dir} was not started by `cadence launch ray`")
    with open(path) as f:
        status = json.load(f)
    status["status_age_seconds"] = round(time.time() - status.get("updated_at", 0.0), 1)
    last = last_metrics(run_dir)
    if last:
        status["step"], status["samples"] = last.get("step"), last.get("samples")
        if "eval/exact_match" in last:
            status["heldout_exact_match"] = last["eval/exact_match"]
    return status


def last_metrics(run_dir: str) -> dict:
    """The last complete line of RUN_DIR/metrics.jsonl ({} when there is none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 65536, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
    return {}


def request_stop(run_dir: str) -> str:
    d = launch_dir(run_dir)
    if not os.path.isfile(os.path.join(d, STATUS_FILE)):
        raise FileNotFoundError(f"{d} has no status.json: {run_dir} was not started by `cadence launch ray`")
    path = os.path.join(d, STOP_FILE)
    with open(path, "w") as f:
        f.write(f"{time.time()}\n")
    return path


def stop_requested(run_dir: str) -> bool:
    return os.path.exists(os.path.join(launch_dir(run_dir), STOP_FILE))
