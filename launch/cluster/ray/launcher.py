"""`cadence launch ray`: a Cadence run placed on a Ray cluster, restarted where it breaks.

    code = RayLaunch(cfg, run_dir, address="10.0.0.1:6379").run()

Ray only places and restarts processes; every byte of training data goes over Cadence's own
ZeroMQ path (the dispatcher and the weight server). The driver:
  1. connects (or starts a local cluster), generates CurveZMQ keys (the learner's in
     RUN_DIR/launch/keys, 0700: learner nodes see the run directory) and hands the actors theirs
     through Ray (never on a command line or in a log);
  2. places the learner's `learner.processes` processes with one placement group (process 0's
     node runs the jax.distributed coordinator and the dispatcher), then each of the
     `actors.processes` actor processes with its own one-bundle group;
  3. watches: an actor process that dies is restarted by Ray (its host exits with it) and
     rejoins the dispatcher, which re-issues its prompts. A learner process that dies ends the
     whole learner group; the group starts again from the newest checkpoint (run.resume=auto),
     at most launch.max_restarts times. If the lost capacity does not come back within
     launch.elastic_timeout_s, the group continues on fewer processes (the checkpoint reshards
     onto the smaller mesh; the batch stays the same) and grows back once it returns;
  4. gathers every process's output into RUN_DIR/logs/ and writes RUN_DIR/launch/status.json.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time

import ray
import yaml
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cadence.launch.cluster.ray import hosts as ray_hosts

from cadence.launch.cluster.ray import status as ray_status
from cadence.launch.cluster.ray.fleet import ActorFleet, LogGatherer
from cadence.launch.config_loader import to_dict
from cadence.launch.artifacts import ENDPOINT_FILE
from cadence._root import IMPORT_ROOT
from cadence.learner import multihost

EXIT_CONFIG, EXIT_FINISHED = 2, 3  # as `cadence train`: a bad config, a run that already finished
POLL_S = 0.5
HOST_TIMEOUT_S = 120.0  # a placed host must answer within this (a loaded machine can be slow)


def _resources(entries) -> dict[str, float]:
    return {k.strip(): float(v) for k, _, v in (e.partition("=") for e in entries)}


def _keys(directory: str) -> dict:
    """A fresh CurveZMQ key set in `directory` (0700; the learner's, as actors.keys_dir), and the
    files an actor needs, as bytes to hand out through Ray."""
    from cadence.protocols.zmq_transport import write_keys

    shutil.rmtree(directory, ignore_errors=True)  # an earlier launch's set: nobody listens with it now
    os.makedirs(directory, mode=0o700)
    write_keys(directory)
    files = {}
    for rel in ("server.key", "client.key", "client.key_secret"):
        with open(os.path.join(directory, rel), "rb") as f:
            files[f"keys/{rel}"] = f.read()
    return files


class _Group:
    """One start of the learner: its placement group and hosts."""

    def __init__(self, pg, hosts, size: int, started: float):
        self.pg, self.hosts, self.size, self.started = pg, hosts, size, started
        self.infos: list[dict] = []
        self.asked_to_stop = False  # our SIGTERM (a stop, or growing back): exit 0 is not "finished"
        self.ended = False


class RayLaunch:
    def __init__(self, cfg, run_dir: str, address: str | None = None, message=None):
        self.cfg, self.run_dir, self.address = cfg, os.path.abspath(run_dir), address
        self.message = message or (lambda text: print(f"cadence launch: {text}", file=sys.stderr, flush=True))
        self.launch = cfg.launch
        self.target = cfg.learner.processes
        self.t0 = time.time()
        self.learner_restarts = 0
        self.shrinks: list[dict] = []
        self.group: _Group | None = None
        self.fleet: ActorFleet | None = None
        self.first_step_seconds: float | None = None
        self.state = "starting"
        self._stop = threading.Event()
        self._last_grow_check = 0.0

    # -- the whole job ----------------------------------------------------------------------
    def run(self) -> int:
        os.makedirs(ray_status.launch_dir(self.run_dir), exist_ok=True)
        self.logs = LogGatherer(self.run_dir)
        stale_stop = os.path.join(ray_status.launch_dir(self.run_dir), ray_status.STOP_FILE)
        if os.path.exists(stale_stop):
            os.remove(stale_stop)  # a stop asked of an earlier launch of this run
        ray.init(address=self.address, namespace="cadence", log_to_driver=False, logging_level="WARNING",
                 configure_logging=False)
        old = {s: signal.signal(s, lambda *_: self._stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        ray.cloudpickle.register_pickle_by_value(ray_hosts)  # the nodes need not import Cadence for it
        self.Host = ray.remote(ray_hosts.ProcessHost)
        self.keys_dir = os.path.join(ray_status.launch_dir(self.run_dir), "keys")
        actor_files = _keys(self.keys_dir) if self.launch.curve else {}
        self.learner_files = {"config.yaml": yaml.safe_dump(to_dict(self.cfg), sort_keys=False).encode()}
        self.fleet = ActorFleet(self.Host, self.cfg.actors.processes,
                                lambda pg: self._host_options("actor", pg, 0, self.launch.actor_max_restarts),
                                self._env(), actor_files, self.launch.curve, self.logs, self.message)
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
            if outcome == "finished":
                self.state = "finished"
                self._print_summary()
                return 0
            if outcome == "stopped":
                self.state = "stopped"
                self._print_summary()
                return 0
            if outcome in ("config", "already finished"):
                self.state = "failed"
                self.message(f"the learner exited: {outcome} (see {self.run_dir}/logs/learner-0.log); not restarting")
                return EXIT_CONFIG if outcome == "config" else EXIT_FINISHED
            if outcome == "grow":
                size, wait = self.target, self.launch.elastic_timeout_s
                continue
            self.learner_restarts += 1
            if self.learner_restarts > self.launch.max_restarts:
                self.state = "failed"
                self.message(f"the learner failed {self.learner_restarts} times (launch.max_restarts="
                             f"{self.launch.max_restarts}); giving up")
                return 1
            self.message(f"learner group lost ({outcome}); restart {self.learner_restarts}/"
                         f"{self.launch.max_restarts} from the newest checkpoint")
            size, wait = self.target, self.launch.elastic_timeout_s

    # -- the learner group ------------------------------------------------------------------
    def _bundle(self, role: str) -> dict:
        la = self.launch
        cpus, gpus, extra = ((la.learner_cpus, la.learner_gpus, la.learner_resources) if role == "learner"
                             else (la.actor_cpus, la.actor_gpus, la.actor_resources))
        bundle = {"CPU": cpus, **_resources(extra)}
        if gpus:
            bundle["GPU"] = gpus
        return bundle

    def _host_options(self, role: str, pg, index: int, max_restarts: int) -> dict:
        b = self._bundle(role)
        return dict(num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0),
                    resources={k: v for k, v in b.items() if k not in ("CPU", "GPU")} or None,
                    max_restarts=max_restarts, max_concurrency=4,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index))

    def _place(self, size: int, wait: float):
        """A ready placement group of `size` learner bundles, or None after `wait` seconds."""
        pg = placement_group([self._bundle("learner")] * size, strategy=self.launch.learner_strategy)
        ready, _ = ray.wait([pg.ready()], timeout=max(wait, 0.1))
        if ready:
            return pg
        remove_placement_group(pg)
        return None

    def _start_group(self, size: int, wait: float) -> _Group | None:
        pg = self._place(size, wait)
        while pg is None and size > self.launch.min_learner_processes and not self._stop.is_set():
            size -= 1  # elastic: continue on the capacity that is there
            pg = self._place(size, min(wait, 30.0) or 5.0)
        if pg is None:
            return None
        if size < self.target:
            self.shrinks.append({"at": round(time.time() - self.t0, 1), "processes": size, "target": self.target})
            self.message(f"continuing on {size} of {self.target} learner processes (the checkpoint reshards)")
        hosts = [self.Host.options(**self._host_options("learner", pg, i, 0)).remote(
                 f"learner-{i}", None, None, self.learner_files) for i in range(size)]
        try:  # a node that died a moment ago may still look placeable: its host never answers
            return self._start_processes(pg, hosts, size)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            self.message(f"the learner group of {size} did not start ({type(e).__name__}); placing it again")
            for h in hosts:
                ray.kill(h, no_restart=True)
            remove_placement_group(pg)
            return self._start_group(size, wait)

    def _start_processes(self, pg, hosts, size: int) -> _Group:
        infos = ray.get([h.info.remote() for h in hosts], timeout=HOST_TIMEOUT_S)
        leader_ip = infos[0]["node_ip"]
        overrides = [f"run.dir={self.run_dir}", "run.resume=auto", "actors.processes=0", "actors.num_actors=0",
                     f"actors.listen=tcp://{leader_ip}:0", "learner.processes=1"]
        if self.launch.curve:
            overrides.append(f"actors.keys_dir={self.keys_dir}")  # on the run dir, which learner nodes see
        env = self._env()
        if size > 1:
            port = ray.get(hosts[0].free_port.remote(), timeout=HOST_TIMEOUT_S)
            env.update({multihost.ENV_COORDINATOR: f"{leader_ip}:{port}", multihost.ENV_NUM_PROCESSES: str(size)})
        started = time.time()
        for i, h in enumerate(hosts):
            argv = ["-m", "cadence.launch.cli", "train", "--config", "{dir}/config.yaml", *overrides]
            proc_env = {**env, multihost.ENV_PROCESS_ID: str(i)} if size > 1 else env
            ray.get(h.start.remote(argv, proc_env), timeout=HOST_TIMEOUT_S)
        group = _Group(pg, hosts, size, started)
        group.infos = ray.get([h.info.remote() for h in hosts], timeout=HOST_TIMEOUT_S)
        where = ", ".join(f"learner-{i}@{inf['node_ip']}" for i, inf in enumerate(group.infos))
        self.message(f"learner group of {size} placed: {where}")
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
            if self._stop.is_set() or ray_status.stop_requested(self.run_dir):
                return self._stop_group(g, "stopped")
            codes, lost = self._poll(g.hosts)
            if lost:
                self._end_group(g)
                return f"learner-{lost[0]} unreachable (its node or host died)"
            if codes[0] is not None:
                if codes[0] == 0:
                    self._end_group(g)
                    return "grow" if g.asked_to_stop else "finished"
                self._end_group(g)
                fatal = {EXIT_CONFIG: "config", EXIT_FINISHED: "already finished"}
                return fatal.get(codes[0], f"learner-0 exited with {codes[0]}")
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                self._end_group(g)
                return f"learner-{bad[0]} exited with {codes[bad[0]]}"
            if not self.fleet.hosts and self._endpoint_ready(g):
                self.fleet.start(self._endpoint(), self._bundle("actor"))
            now = time.time()
            if now - last_slow >= 1.0:
                last_slow = now
                if self.fleet.hosts:
                    self._check_endpoint(g)
                    self.fleet.poll()
                self._first_step()
                self._gather_logs(g)
                self._write_status()
                if not g.asked_to_stop and self._capacity_returned(g):
                    self.message(f"capacity for {self.target} learner processes is back: checkpointing "
                                 "to grow the group")
                    g.asked_to_stop = True
                    ray.get(g.hosts[0].signal.remote(signal.SIGTERM), timeout=HOST_TIMEOUT_S)
            time.sleep(POLL_S)

    def _poll(self, hosts) -> tuple[list, list[int]]:
        refs = [h.poll.remote() for h in hosts]
        codes, lost = [], []
        for i, ref in enumerate(refs):
            try:
                codes.append(ray.get(ref, timeout=30))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                codes.append(None)
                lost.append(i)
        return codes, lost

    def _stop_group(self, g: _Group, outcome: str) -> str:
        """SIGTERM to process 0: a final checkpoint, the others stopped by it, exit 0."""
        self.state = "stopping"
        self.message("stopping: the learner writes a final checkpoint")
        deadline = self.cfg.checkpoint.signal_timeout_seconds + 60.0
        try:
            ray.get(g.hosts[0].stop.remote(deadline), timeout=deadline + 10)
            ray.get([h.stop.remote(30.0) for h in g.hosts[1:]], timeout=40)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        self._end_group(g)
        return outcome

    def _end_group(self, g: _Group) -> None:
        if g.ended:
            return
        g.ended = True
        self._gather_logs(g)
        for h in g.hosts:
            try:
                ray.get(h.stop.remote(2.0), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            ray.kill(h, no_restart=True)
        remove_placement_group(g.pg)

    def _capacity_returned(self, g: _Group) -> bool:
        """A shrunk group: can the missing learner bundles be placed again? (probe, then release)"""
        if g.size >= self.target or not self.launch.grow_check_s:
            return False
        if time.time() - self._last_grow_check < self.launch.grow_check_s:
            return False
        self._last_grow_check = time.time()
        probe = placement_group([self._bundle("learner")] * (self.target - g.size), strategy="PACK")
        ready, _ = ray.wait([probe.ready()], timeout=2.0)
        remove_placement_group(probe)
        return bool(ready)

    # -- actors -----------------------------------------------------------------------------
    def _endpoint_ready(self, g: _Group) -> bool:
        path = os.path.join(self.run_dir, ENDPOINT_FILE)
        return os.path.isfile(path) and os.path.getmtime(path) >= g.started - 1.0

    def _endpoint(self) -> str:
        with open(os.path.join(self.run_dir, ENDPOINT_FILE)) as f:
            return json.load(f)["dispatch"]

    def _check_endpoint(self, g: _Group) -> None:
        """A learner restarted elsewhere listens elsewhere: the actors start again, pointed there."""
        if self._endpoint_ready(g) and self._endpoint() != self.fleet.endpoint:
            self.message(f"the learner moved to {self._endpoint()}; restarting the actors")
            self.fleet.stop()
            self.fleet.start(self._endpoint(), self._bundle("actor"))

    # -- logs and status --------------------------------------------------------------------
    def _gather_logs(self, g: _Group) -> None:
        for i, h in enumerate(g.hosts):
            pid = g.infos[i]["host_pid"] if i < len(g.infos) else None
            self.logs.gather(f"learner-{i}", h, pid)

    def _first_step(self) -> None:
        if self.first_step_seconds is None and ray_status.last_metrics(self.run_dir).get("step", 0) >= 1:
            self.first_step_seconds = round(time.time() - self.t0, 2)

    def _write_status(self) -> None:
        g = self.group
        nodes = [{"node_id": n["NodeID"], "address": n["NodeManagerAddress"], "alive": n["Alive"],
                  "resources": n.get("Resources", {})} for n in ray.nodes()]
        ray_status.write_status(self.run_dir, {
            "state": self.state, "updated_at": time.time(), "launched_at": self.t0, "driver_pid": os.getpid(),
            "ray_address": self.address or "local", "first_step_seconds": self.first_step_seconds,
            "learner": {"processes": g.size if g else 0, "target": self.target, "restarts": self.learner_restarts,
                        "shrinks": self.shrinks,
                        "hosts": [{k: inf.get(k) for k in ("name", "node_ip", "node_id", "pid")}
                                  for inf in (g.infos if g else [])]},
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
            self._end_group(self.group)
        if self.fleet is not None and self.fleet.hosts:
            self.fleet.stop()
        try:
            self._write_status()
        except Exception as e:  # the cluster may be gone; the status file keeps its last state
            self.message(f"final status not written: {e}")
