"""The driver of `cadence launch ray`: places the run on a Ray cluster and keeps it whole.

    code = RayDriver(cfg, run_dir, address="10.0.0.1:6379").run()

Ray only places and restarts processes; every byte of training data goes over Cadence's own
ZeroMQ path (the dispatcher and the weight server). The driver:
  1. connects (or starts a local cluster), generates CurveZMQ keys (the learner's in
     RUN_DIR/launch/keys, 0700: learner nodes see the run directory) and hands the actors theirs
     through Ray (never on a command line or in a log);
  2. places the learner's `learner.processes` processes with one placement group (process 0's
     node runs the jax.distributed coordinator and the dispatcher; learner_hosts.py), then each
     of the `actors.processes` actor processes with its own one-bundle group (fleet.py);
  3. watches: an actor process that dies is restarted by Ray (its host exits with it) and
     rejoins the dispatcher, which re-issues its prompts; one restarted more than
     launch.actor_restart_budget times within launch.actor_restart_window_s is a crash loop,
     which fails the run (exit 1) with its last error. A learner process that dies ends the
     whole learner group; the group starts again from the newest checkpoint (run.resume=auto),
     at most launch.max_restarts times. If the lost capacity does not come back within
     launch.elastic_timeout_s, the group continues on fewer processes (the checkpoint reshards
     onto the smaller mesh; a microbatch that does not split over it is re-planned and the batch
     refit, learner/row_plan.py) and grows back once a probe placed with the group's own
     strategy (launch.learner_strategy) finds the capacity;
  4. gathers every process's output into RUN_DIR/logs/ and writes RUN_DIR/launch/status.json.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import ray
import yaml

from cadence._root import IMPORT_ROOT
from cadence.launch.artifacts import ENDPOINT_FILE
from cadence.launch.cluster import launch_state
from cadence.launch.cluster.ray import hosts as ray_hosts
from cadence.launch.cluster.ray import placement
from cadence.launch.cluster.ray.fleet import ActorFleet, LogGatherer
from cadence.launch.cluster.ray.learner_hosts import LearnerGroup
from cadence.launch.cluster.restart_budget import RestartBudget
from cadence.launch.config_loader import to_dict

POLL_S = 0.5


class RayDriver:
    def __init__(self, cfg, run_dir: str, address: str | None = None, message=None):
        self.cfg, self.run_dir, self.address = cfg, os.path.abspath(run_dir), address
        self.message = message or (lambda text: print(f"cadence launch: {text}", file=sys.stderr, flush=True))
        self.launch = cfg.launch
        self.target = cfg.learner.processes
        self.t0 = time.time()
        self.learner_restarts = 0
        self.shrinks: list[dict] = []
        self.group: LearnerGroup | None = None
        self.fleet: ActorFleet | None = None
        self.first_step_seconds: float | None = None
        self.state = "starting"
        self._stop = threading.Event()
        self._last_grow_check = 0.0
        self.failure = ""  # why the run failed, when the driver decided it (status.json has it)

    # -- the whole job ----------------------------------------------------------------------
    def run(self) -> int:
        os.makedirs(launch_state.launch_dir(self.run_dir), exist_ok=True)
        self.logs = LogGatherer(self.run_dir)
        launch_state.clear_stop(self.run_dir)
        ray.init(address=self.address, namespace="cadence", log_to_driver=False, logging_level="WARNING",
                 configure_logging=False)
        old = {s: signal.signal(s, lambda *_: self._stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        ray.cloudpickle.register_pickle_by_value(ray_hosts)  # the nodes need not import Cadence for it
        self.Host = ray.remote(ray_hosts.ProcessHost)
        self.keys_dir, actor_files = "", {}
        if self.launch.curve:
            self.keys_dir, actor_files = launch_state.write_keys(self.run_dir)
        self.learner_files = {"config.yaml": yaml.safe_dump(to_dict(self.cfg), sort_keys=False).encode()}
        actor_env = {**self._env(), **dict(e.split("=", 1) for e in self.launch.actor_env)}
        self.fleet = ActorFleet(self.Host, self.cfg.actors.processes,
                                lambda pg: placement.host_options(self.launch, "actor", pg, 0,
                                                                  self.launch.actor_max_restarts),
                                actor_env, actor_files, self.launch.curve, self.logs, self.message,
                                RestartBudget(self.launch.actor_restart_budget, self.launch.actor_restart_window_s))
        try:
            return self._supervise()
        except BaseException:
            self.state = "failed"
            raise
        finally:
            self._teardown()
            for s, h in old.items():
                signal.signal(s, h)
            ray.shutdown()

    def _supervise(self) -> int:
        size, wait = self.target, self.launch.place_timeout_s
        while True:
            self.group = self._start_group(size, wait)
            if self.group is None:
                self.message(f"no placement for {self.launch.min_learner_processes}+ learner processes "
                             f"within {wait:.0f} s; giving up")
                self.state = "failed"
                return 1
            self.state = "running"
            outcome = self._watch_group()
            if outcome == "grow":
                size, wait = self.target, self.launch.elastic_timeout_s
                continue
            if outcome == "crash loop":  # restarting the learner would not mend the actors
                self.state = "failed"
                self.message(f"{self.failure}; the run fails (the learner checkpointed first)")
                return 1
            code = launch_state.end_or_restart(self, outcome, "learner group")
            if code is not None:
                if code == 0:
                    self._print_summary()
                return code
            size, wait = self.target, self.launch.elastic_timeout_s

    # -- the learner group ------------------------------------------------------------------
    def _start_group(self, size: int, wait: float) -> LearnerGroup | None:
        group = LearnerGroup.start(self.Host, self.cfg, self.run_dir, size, wait, files=self.learner_files,
                                   keys_dir=self.keys_dir, env=self._env(), message=self.message,
                                   stopping=self._stop.is_set)
        if group is not None and group.size < self.target:
            self.shrinks.append({"at": round(time.time() - self.t0, 1), "processes": group.size,
                                 "target": self.target})
            self.message(f"continuing on {group.size} of {self.target} learner processes (the checkpoint reshards)")
        return group

    def _env(self) -> dict:
        env = {"PYTHONPATH": os.pathsep.join(p for p in (IMPORT_ROOT, os.environ.get("PYTHONPATH", "")) if p)}
        env.update(dict(e.split("=", 1) for e in self.launch.env))
        return env

    def _watch_group(self) -> str:
        """Until the group ends: "finished", "stopped", "grow", "config", or why it was lost."""
        g = self.group
        last_slow = 0.0
        while True:
            if self._stop.is_set() or launch_state.stop_requested(self.run_dir):
                return self._stop_group(g, "stopped")
            codes, lost = g.poll()
            if lost:
                g.end(self.logs)
                return f"learner-{lost[0]} unreachable (its node or host died)"
            if codes[0] is not None:
                g.end(self.logs)
                if codes[0] == 0 and g.asked_to_stop:
                    return "grow"
                return launch_state.learner_exit(codes[0], f"learner-0 exited with {codes[0]}")
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                g.end(self.logs)
                return f"learner-{bad[0]} exited with {codes[bad[0]]}"
            if not self.fleet.hosts and self._endpoint_ready(g):
                self.fleet.start(self._endpoint(), placement.bundle(self.launch, "actor"))
            now = time.time()
            if now - last_slow >= 1.0:
                last_slow = now
                if self.fleet.hosts:
                    self._check_endpoint(g)
                    self.fleet.poll()
                    self.failure = self.fleet.crash_loop() or ""
                    if self.failure:
                        self.message(self.failure)
                        return self._stop_group(g, "crash loop")
                self._first_step()
                g.gather_logs(self.logs)
                self._write_status()
                if not g.asked_to_stop and self._capacity_returned(g):
                    self.message(f"capacity for {self.target} learner processes is back: checkpointing "
                                 "to grow the group")
                    g.asked_to_stop = True
                    g.signal_leader(signal.SIGTERM)
            time.sleep(POLL_S)

    def _stop_group(self, g: LearnerGroup, outcome: str) -> str:
        self.state = "stopping"
        self.message("stopping: the learner writes a final checkpoint")
        g.checkpoint_and_stop(self.cfg.checkpoint.signal_timeout_seconds + 60.0)
        g.end(self.logs)
        return outcome

    def _capacity_returned(self, g: LearnerGroup) -> bool:
        """A shrunk group: can the missing learner bundles be placed again?"""
        if g.size >= self.target or not self.launch.grow_check_s:
            return False
        if time.time() - self._last_grow_check < self.launch.grow_check_s:
            return False
        self._last_grow_check = time.time()
        return placement.capacity_free(self.launch, self.target - g.size, [h["node_id"] for h in g.status()])

    # -- actors -----------------------------------------------------------------------------
    def _endpoint_ready(self, g: LearnerGroup) -> bool:
        path = os.path.join(self.run_dir, ENDPOINT_FILE)
        return os.path.isfile(path) and os.path.getmtime(path) >= g.started - 1.0

    def _endpoint(self) -> str:
        with open(os.path.join(self.run_dir, ENDPOINT_FILE)) as f:
            return json.load(f)["dispatch"]

    def _check_endpoint(self, g: LearnerGroup) -> None:
        """A learner restarted elsewhere listens elsewhere: the actors start again, pointed there."""
        if self._endpoint_ready(g) and self._endpoint() != self.fleet.endpoint:
            self.message(f"the learner moved to {self._endpoint()}; restarting the actors")
            self.fleet.stop()
            self.fleet.start(self._endpoint(), placement.bundle(self.launch, "actor"))

    # -- status -----------------------------------------------------------------------------
    def _first_step(self) -> None:
        if self.first_step_seconds is None and launch_state.last_metrics(self.run_dir).get("step", 0) >= 1:
            self.first_step_seconds = round(time.time() - self.t0, 2)

    def _write_status(self) -> None:
        g = self.group
        nodes = [{"node_id": n["NodeID"], "address": n["NodeManagerAddress"], "alive": n["Alive"],
                  "resources": n.get("Resources", {})} for n in ray.nodes()]
        launch_state.write_status(self.run_dir, {
            "state": self.state, "failure": self.failure or None, "updated_at": time.time(), "launched_at": self.t0, "driver_pid": os.getpid(),
            "ray_address": self.address or "local", "first_step_seconds": self.first_step_seconds,
            "learner": {"processes": g.size if g else 0, "target": self.target, "restarts": self.learner_restarts,
                        "shrinks": self.shrinks, "hosts": g.status() if g else []},
            "actors": self.fleet.status() if self.fleet else {},
            "nodes": nodes,
        })

    def _print_summary(self) -> None:
        path = os.path.join(self.run_dir, "summary.json")
        if os.path.isfile(path):
            with open(path) as f:
                summary = json.load(f)
            summary["launch"] = {"learner_restarts": self.learner_restarts, "shrinks": self.shrinks,
                                 "actor_restarts": sum(self.fleet.restarts.values()),
                                 "first_step_seconds": self.first_step_seconds}
            print(json.dumps(summary), flush=True)

    def _teardown(self) -> None:
        if self.group is not None and not self.group.ended:  # the driver itself failed or was interrupted
            self.group.end(self.logs)
        if self.fleet is not None and self.fleet.hosts:
            self.fleet.stop()
        try:
            self._write_status()
        except Exception as e:  # the cluster may be gone; the status file keeps its last state
            self.message(f"final status not written: {e}")
