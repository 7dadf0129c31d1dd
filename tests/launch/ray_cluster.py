"""Helpers of the tests against a real cluster (ray_launch_test.py, ray_sglang_test.py,
launcher_contract_test.py): start `cadence launch KIND` on it, wait on and read the launch's
status, finish it. The fixtures that start the clusters are in conftest.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from cadence.launch.cluster import launch_state
from cadence.launch.cluster.ray.local_cluster import HEAD_RESOURCE, WORKER_RESOURCE
from tests import waiting

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLACE = [f"launch.learner_resources=[{HEAD_RESOURCE}=0.1]", f"launch.actor_resources=[{WORKER_RESOURCE}=0.1]"]
SHORT = ["learner.sft.steps=5", "task.heldout_size=32", "run.progress=false", "run.eval_every=1000",
         "checkpoint.every_steps=4", "checkpoint.keep=50"]


DRIVERS: list[subprocess.Popen] = []


def start_launch(kind, args, run_dir, *overrides, env=None) -> subprocess.Popen:
    """`cadence launch KIND ARGS run.dir=RUN_DIR OVERRIDES`, its stderr in RUN_DIR/../driver.log."""
    env = dict(env or os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    log = open(os.path.join(os.path.dirname(run_dir), "driver.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "cadence.launch.cli", "launch", kind, *args,
                             f"run.dir={run_dir}", *overrides], stdout=subprocess.PIPE, stderr=log, text=True,
                            env=env, cwd=ROOT)
    proc.run_dir = run_dir  # for wait_for's report when the driver dies
    DRIVERS.append(proc)
    return proc


def launch(cluster, run_dir, *overrides) -> subprocess.Popen:
    return start_launch("ray", ["--address", cluster.address], run_dir, *overrides)


def stop_launch(run_dir, kind="ray", env=None) -> None:
    """`cadence launch KIND --stop RUN_DIR`, as a user stops a run."""
    subprocess.run([sys.executable, "-m", "cadence.launch.cli", "launch", kind, "--stop", run_dir], check=True,
                   cwd=ROOT, env=dict(env or os.environ, PYTHONPATH=ROOT), capture_output=True)


def finish(proc, run_dir, timeout) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    driver_log = open(os.path.join(os.path.dirname(run_dir), "driver.log")).read()
    assert proc.returncode == 0, driver_log[-3000:] + _logs(run_dir)
    return json.loads(out.strip().splitlines()[-1])


def _logs(run_dir) -> str:
    d = os.path.join(run_dir, "logs")
    if not os.path.isdir(d):
        return ""
    return "".join(f"\n--- {n}\n" + open(os.path.join(d, n), errors="replace").read()[-2000:] for n in os.listdir(d))


def status(run_dir) -> dict:
    try:
        return launch_state.read_status(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_for(pred, timeout, what, proc=None):
    try:
        return waiting.wait_for(pred, timeout, what, proc, interval=1.0)  # status reads are slow: poll gently
    except AssertionError as e:  # the driver's stderr and the processes' logs are files: say what they said
        run_dir = getattr(proc, "run_dir", None)
        if run_dir is None:
            raise
        log = os.path.join(os.path.dirname(run_dir), "driver.log")
        driver = open(log, errors="replace").read()[-4000:] if os.path.exists(log) else ""
        raise AssertionError(f"{e}\n--- driver.log\n{driver}{_logs(run_dir)}") from None


def node_ids(st) -> dict:
    """resource name -> node id, from the status' node list."""
    return {r: n["node_id"] for n in st["nodes"] if n["alive"] for r in (HEAD_RESOURCE, WORKER_RESOURCE)
            if r in n["resources"]}


def stop_drivers() -> None:
    """A failed test leaves its launch running: stop it (it stops what it placed)."""
    while DRIVERS:
        proc = DRIVERS.pop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
