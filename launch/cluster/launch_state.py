"""What every `cadence launch KIND` leaves in RUN_DIR/launch/, and the two commands that read it.

    cadence launch KIND --status RUN_DIR   # processes, nodes, restarts, step, samples (JSON)
    cadence launch KIND --stop RUN_DIR     # ask the driver to stop: final checkpoint, actors leave

A launcher's driver rewrites RUN_DIR/launch/status.json about once a second and polls
RUN_DIR/launch/stop; a stop is a file (not a signal) so it works from any machine that sees the
run directory. The CurveZMQ keys of a launch live in RUN_DIR/launch/keys (0700). No cluster
library here: reading a status needs no cluster connection.
"""
from __future__ import annotations

import json
import os
import shutil
import time

LAUNCH_DIR = "launch"
STATUS_FILE = "status.json"
STOP_FILE = "stop"
KEYS_DIR = "keys"
ACTOR_KEY_FILES = ("server.key", "client.key", "client.key_secret")  # what `cadence actor --keys` reads
EXIT_CONFIG, EXIT_FINISHED = 2, 3  # as `cadence train`: a bad config, a run that already finished


def learner_exit(code: int, lost: str) -> str:
    """The outcome of learner process 0's exit status (0 is "finished"): "config" and "already
    finished" end a launch, anything else (`lost`, e.g. "learner-0 exited with 1") restarts it."""
    if code == 0:
        return "finished"
    return {EXIT_CONFIG: "config", EXIT_FINISHED: "already finished"}.get(code, lost)


def end_or_restart(driver, outcome: str, what: str) -> int | None:
    """Every launcher's one rule for a learner that ended: the exit status to end the launch with
    (0 finished or stopped, 2/3 as `cadence train`, 1 when launch.max_restarts restarts are spent),
    or None after counting one more restart from the newest checkpoint. driver: a launcher's
    driver (state, learner_restarts, launch, run_dir, message); what: "learner group", ..."""
    if outcome in ("finished", "stopped"):
        driver.state = outcome
        return 0
    if outcome in ("config", "already finished"):
        driver.state = "failed"
        driver.message(f"the learner exited: {outcome} (see {driver.run_dir}/logs/learner-0.log); not restarting")
        return EXIT_CONFIG if outcome == "config" else EXIT_FINISHED
    driver.learner_restarts += 1
    if driver.learner_restarts > driver.launch.max_restarts:
        driver.state = "failed"
        driver.message(f"the learner failed {driver.learner_restarts} times (launch.max_restarts="
                       f"{driver.launch.max_restarts}); giving up")
        return 1
    driver.message(f"{what} lost ({outcome}); restart {driver.learner_restarts}/"
                   f"{driver.launch.max_restarts} from the newest checkpoint")
    return None


def launch_dir(run_dir: str) -> str:
    return os.path.join(run_dir, LAUNCH_DIR)


def write_status(run_dir: str, status: dict) -> None:
    path = os.path.join(launch_dir(run_dir), STATUS_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(status, f, indent=1)
    os.replace(tmp, path)  # a reader never sees half a file


def read_status(run_dir: str, kind: str = "ray") -> dict:
    """The driver's last status, with the newest step and samples from metrics.jsonl."""
    path = os.path.join(launch_dir(run_dir), STATUS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {run_dir} was not started by `cadence launch {kind}`")
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


def request_stop(run_dir: str, kind: str = "ray") -> str:
    d = launch_dir(run_dir)
    if not os.path.isfile(os.path.join(d, STATUS_FILE)):
        raise FileNotFoundError(f"{d} has no status.json: {run_dir} was not started by `cadence launch {kind}`")
    path = os.path.join(d, STOP_FILE)
    with open(path, "w") as f:
        f.write(f"{time.time()}\n")
    return path


def stop_requested(run_dir: str) -> bool:
    return os.path.exists(os.path.join(launch_dir(run_dir), STOP_FILE))


def clear_stop(run_dir: str) -> None:
    """A stop asked of an earlier launch of this run is not a stop of this one."""
    path = os.path.join(launch_dir(run_dir), STOP_FILE)
    if os.path.exists(path):
        os.remove(path)


def write_keys(run_dir: str) -> tuple[str, dict[str, bytes]]:
    """A fresh CurveZMQ key set in RUN_DIR/launch/keys (0700; the learner's, as actors.keys_dir),
    and the files an actor needs, as bytes for a launcher that hands them out itself."""
    from cadence.protocols.zmq_transport import write_keys as write_key_set

    directory = os.path.join(launch_dir(run_dir), KEYS_DIR)
    shutil.rmtree(directory, ignore_errors=True)  # an earlier launch's set: nobody listens with it now
    os.makedirs(directory, mode=0o700)
    write_key_set(directory)
    files = {}
    for rel in ACTOR_KEY_FILES:
        with open(os.path.join(directory, rel), "rb") as f:
            files[f"keys/{rel}"] = f.read()
    return directory, files
