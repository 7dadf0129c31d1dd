"""The driver inside a `cadence launch slurm` job: srun steps for the learner and the actors.

    python -m cadence.launch.cluster.slurm.job RUN_DIR     # the batch script's one command

Runs on the allocation's first node. The learner is one step of `learner.processes` tasks
(`cadence train ... run.resume=auto`; for more than one, a jax.distributed group whose
coordinator is this node); once it has written RUN_DIR/endpoint.json, each of the
`actors.processes` actors is a one-task step of its own (`cadence actor --connect ENDPOINT`), so
one can die and come back alone. This driver restarts an actor step that exits unasked
(launch.actor_max_restarts) and the learner step from its newest checkpoint (launch.max_restarts);
a lost node ends the whole job, which SLURM requeues (`--requeue`), and the job starts again from
the checkpoint. RUN_DIR/launch/stop, SIGTERM or SIGINT (scancel, the time limit's
`--signal=B:TERM@...`) stop it cleanly: SIGTERM to the learner's tasks (a final checkpoint; its
followers ignore SIGTERM and follow process 0), then to the actors. Output goes to
RUN_DIR/logs/NAME.log; the status to RUN_DIR/launch/status.json (launch_state.py).
"""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from cadence.launch.artifacts import ENDPOINT_FILE
from cadence.launch.cluster import launch_state
from cadence.launch.cluster.slurm import steps as slurm

POLL_S = 0.5
ACTOR_BACKOFF_S = 1.0


def config_path(run_dir: str) -> str:
    return os.path.join(launch_state.launch_dir(run_dir), "config.yaml")


class _Step:
    def __init__(self, name: str, proc: subprocess.Popen):
        self.name, self.proc, self.started = name, proc, time.time()
        self.asked_to_stop = False


class SlurmJob:
    def __init__(self, run_dir: str, message=None):
        from cadence.launch.config import load_config

        self.run_dir = os.path.abspath(run_dir)
        self.cfg = load_config([config_path(self.run_dir)])
        self.launch = self.cfg.launch
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self.message = message or (lambda text: print(f"cadence launch slurm: {text}", file=sys.stderr, flush=True))
        self.t0 = time.time()
        self.state = "starting"
        self.learner: _Step | None = None
        self.actors: dict[str, _Step] = {}
        self.actor_restarts: dict[str, int] = {}
        self.restart_at: dict[str, float] = {}
        self.endpoint = ""
        self.learner_restarts = 0
        self.first_step_seconds: float | None = None
        self._steps: dict[str, dict] = {}
        self._stop = threading.Event()
        self.keys_dir = os.path.join(launch_state.launch_dir(self.run_dir), launch_state.KEYS_DIR)

    # -- commands ---------------------------------------------------------------------------
    def _srun(self, name: str, ntasks: int, cpus: float, gpus: float, argv: list[str], log: str,
              extra: list[str] = ()) -> subprocess.Popen:
        cmd = ["srun", f"--job-name={name}", f"--ntasks={ntasks}", f"--cpus-per-task={max(1, math.ceil(cpus))}",
               "--exact", "--kill-on-bad-exit=1", f"--output={os.path.join(self.run_dir, 'logs', log)}",
               "--open-mode=append", *extra]
        if gpus:
            cmd.append(f"--gpus-per-task={math.ceil(gpus)}")
        return subprocess.Popen([*cmd, *argv], stdin=subprocess.DEVNULL, start_new_session=True)

    def _start_learner(self) -> _Step:
        from cadence.learner import multihost  # not at import: `cadence --help` lists this launcher without NumPy

        size = self.cfg.learner.processes
        host = socket.gethostname()
        address = slurm.node_address(host) if self.job_id else "127.0.0.1"
        overrides = [f"run.dir={self.run_dir}", "run.resume=auto", "actors.processes=0", "actors.num_actors=0",
                     f"actors.listen=tcp://{address}:0", "learner.processes=1"]
        if self.launch.curve:
            overrides.append(f"actors.keys_dir={self.keys_dir}")
        argv = [sys.executable, "-m", "cadence.launch.cli", "train", "--config", config_path(self.run_dir),
                *overrides]
        extra = []
        if size > 1:  # task i is process i; process 0 runs on this node (--relative=0), the coordinator's
            with socket.socket() as s:
                s.bind((address, 0))
                port = s.getsockname()[1]
            os.environ[multihost.ENV_COORDINATOR] = f"{address}:{port}"
            os.environ[multihost.ENV_NUM_PROCESSES] = str(size)
            argv = ["bash", "-c", f'export {multihost.ENV_PROCESS_ID}=$SLURM_PROCID; exec "$@"', "learner", *argv]
            extra = ["--relative=0"]
        proc = self._srun("learner", size, self.launch.learner_cpus, self.launch.learner_gpus, argv,
                          "learner-%t.log", extra)
        self.message(f"learner step of {size} started (listening on {address})")
        return _Step("learner", proc)

    def _start_actor(self, name: str) -> None:
        argv = [sys.executable, "-m", "cadence.launch.cli", "actor", "--connect", self.endpoint, "--id", name]
        if self.launch.curve:
            argv += ["--keys", self.keys_dir]
        self.actors[name] = _Step(name, self._srun(name, 1, self.launch.actor_cpus, self.launch.actor_gpus, argv,
                                                   f"{name}.log"))

    # -- the job ----------------------------------------------------------------------------
    def run(self) -> int:
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        old = {s: signal.signal(s, lambda *_: self._stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._supervise()
        except BaseException:
            self.state = "failed"
            raise
        finally:
            self._stop_actors()
            if self.learner is not None and self.learner.proc.poll() is None:
                self.learner.proc.kill()
            self._write_status()
            for s, h in old.items():
                signal.signal(s, h)

    def _supervise(self) -> int:
        while True:
            self.learner = self._start_learner()
            self.state = "running"
            outcome = self._watch()  # the actors stay: they rejoin a restarted learner at its address
            code = launch_state.end_or_restart(self, outcome, "learner step")
            if code is not None:
                return code

    def _watch(self) -> str:
        g, last_slow = self.learner, 0.0
        while True:
            if self._stop.is_set() or launch_state.stop_requested(self.run_dir):
                return self._stop_learner(g)
            code = g.proc.poll()
            if code is not None:
                return launch_state.learner_exit(code, f"the learner step exited with {code}")
            endpoint = self._endpoint(g)
            if endpoint and endpoint != self.endpoint:
                if self.actors:
                    self.message(f"the learner moved to {endpoint}; restarting the actors")
                    self._stop_actors()
                self.endpoint = endpoint
                for i in range(self.cfg.actors.processes):
                    self._start_actor(f"actor-{i}")
                self.message(f"{self.cfg.actors.processes} actor steps started (connecting to {endpoint})")
            self._restart_actors()
            now = time.time()
            if now - last_slow >= 1.0:
                last_slow = now
                if self.first_step_seconds is None and launch_state.last_metrics(self.run_dir).get("step", 0) >= 1:
                    self.first_step_seconds = round(now - self.t0, 2)
                self._write_status()
            time.sleep(POLL_S)

    def _endpoint(self, g: _Step) -> str:
        path = os.path.join(self.run_dir, ENDPOINT_FILE)
        if not os.path.isfile(path) or os.path.getmtime(path) < g.started - 1.0:
            return ""  # none yet, or an earlier learner's
        try:
            with open(path) as f:
                return json.load(f)["dispatch"]
        except (ValueError, KeyError):
            return ""

    def _restart_actors(self) -> None:
        now = time.time()
        for name, step in list(self.actors.items()):
            code = step.proc.poll()
            if code is None or step.asked_to_stop or code == 0:
                continue
            if name not in self.restart_at:
                limit, done = self.launch.actor_max_restarts, self.actor_restarts.get(name, 0)
                if limit != -1 and done >= limit:
                    continue  # as Ray's max_restarts: the actor stays dead
                self.message(f"{name} exited with {code}; restarting it")
                self.restart_at[name] = now + ACTOR_BACKOFF_S
            elif now >= self.restart_at[name]:
                del self.restart_at[name]
                self.actor_restarts[name] = self.actor_restarts.get(name, 0) + 1
                self._start_actor(name)

    def _signal(self, name: str, signal_name: str) -> bool:
        step = self._query_steps().get(name)  # now: a restarted learner is a new step
        if not step:
            return False
        try:
            slurm.signal_step(step["step"], signal_name)
            return True
        except slurm.SlurmError as e:
            self.message(f"{name}: {e}")
            return False

    def _stop_learner(self, g: _Step) -> str:
        """SIGTERM to the learner's tasks: process 0 writes a final checkpoint and stops the others."""
        self.state = "stopping"
        self.message("stopping: the learner writes a final checkpoint")
        g.asked_to_stop = True
        if not self._signal("learner", "TERM"):
            g.proc.send_signal(signal.SIGTERM)  # not a step yet: srun passes it on
        try:
            g.proc.wait(self.cfg.checkpoint.signal_timeout_seconds + 60.0)
        except subprocess.TimeoutExpired:
            g.proc.kill()
        return "stopped"

    def _stop_actors(self) -> None:
        """SIGTERM: the actors leave (their prompts go back); srun ends with its step."""
        for name, step in self.actors.items():
            step.asked_to_stop = True
            if step.proc.poll() is None and not self._signal(name, "TERM"):
                step.proc.send_signal(signal.SIGTERM)
        for step in self.actors.values():
            try:
                step.proc.wait(30)
            except subprocess.TimeoutExpired:
                step.proc.kill()
        self.actors, self.restart_at = {}, {}

    def _query_steps(self) -> dict[str, dict]:
        if not self.job_id:
            return {}
        try:
            self._steps = slurm.steps(self.job_id)
        except slurm.SlurmError:
            pass
        return self._steps

    def _write_status(self) -> None:
        found = self._query_steps()

        def host(name: str, step: _Step | None) -> dict:
            code = step.proc.poll() if step else None
            return {"name": name, "state": "running" if step and code is None else f"exited {code}",
                    "restarts": self.actor_restarts.get(name, 0), "pid": step.proc.pid if step else None,
                    "step": found.get(name, {}).get("step"), "node": found.get(name, {}).get("nodes")}

        size = self.cfg.learner.processes
        launch_state.write_status(self.run_dir, {
            "state": self.state, "updated_at": time.time(), "launched_at": self.t0, "driver_pid": os.getpid(),
            "slurm_job_id": self.job_id, "first_step_seconds": self.first_step_seconds,
            "learner": {"processes": size if self.learner else 0, "target": size, "restarts": self.learner_restarts,
                        "hosts": [host("learner", self.learner)] if self.learner else []},
            "actors": {"processes": len(self.actors), "endpoint": self.endpoint,
                       "restarts": sum(self.actor_restarts.values()),
                       "hosts": [host(n, s) for n, s in sorted(self.actors.items())]},
            "launch": {"learner_restarts": self.learner_restarts, "shrinks": [],
                       "actor_restarts": sum(self.actor_restarts.values()),
                       "first_step_seconds": self.first_step_seconds},
        })


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m cadence.launch.cluster.slurm.job RUN_DIR", file=sys.stderr)
        return 2
    return SlurmJob(argv[0]).run()


if __name__ == "__main__":
    sys.exit(main())
