"""The actor processes of `cadence launch ray`, and gathering any host's output into the run dir.

    fleet = ActorFleet(Host, n, host_options, env, files, logs, message)
    fleet.start("tcp://10.0.0.5:41343")   # one one-bundle placement group and one Ray host per actor
    fleet.poll()                          # each host's process, node, restarts; their output gathered
    fleet.stop()                          # SIGTERM: the actors leave (their prompts go back)
    fleet.crash_loop()                    # "actor-0 restarted 6 times within 300 s ...: ERROR" or None

Each host runs `cadence actor --connect ENDPOINT --id actor-i`; Ray restarts a host whose actor
died (launch.actor_max_restarts), so a restart shows up here as a new host pid or node; more
restarts of one actor than launch.actor_restart_budget within launch.actor_restart_window_s are
a crash loop (launch/cluster/restart_budget.py), which the driver ends the run with.
"""
from __future__ import annotations

import os

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from cadence.launch.cluster.restart_budget import RestartBudget, last_error


class LogGatherer:
    """Appends what each host's process wrote since last time to RUN_DIR/logs/NAME.log."""

    def __init__(self, run_dir: str):
        self.dir = os.path.join(run_dir, "logs")
        os.makedirs(self.dir, exist_ok=True)
        self.offsets: dict[str, tuple] = {}  # name -> (host pid, bytes gathered)

    def gather(self, name: str, host, host_pid) -> None:
        last_pid, offset = self.offsets.get(name, (host_pid, 0))
        if host_pid != last_pid:  # a restarted host starts a new output file
            offset = 0
        try:
            while True:
                chunk = ray.get(host.read_log.remote(offset), timeout=10)
                if not chunk:
                    break
                with open(os.path.join(self.dir, f"{name}.log"), "ab") as f:
                    f.write(chunk)
                offset += len(chunk)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # a dead or restarting host: its last words are lost with its node
        self.offsets[name] = (host_pid, offset)


class ActorFleet:
    def __init__(self, Host, n: int, host_options, env: dict, files: dict, curve: bool, logs: LogGatherer,
                 message, budget: RestartBudget | None = None):
        self.Host, self.n, self.host_options = Host, n, host_options  # host_options(pg) -> .options kwargs
        self.env, self.files, self.logs, self.message = env, files, logs, message
        self.file_args = ["--keys", "{dir}/keys"] if curve else []
        self.endpoint = ""
        self.hosts: list = []
        self.pgs: list = []
        self.infos: dict[str, dict] = {}
        self.restarts: dict[str, int] = {}
        self.budget = budget or RestartBudget(0, 1.0)
        self.placed: set[str] = set()  # hosts this fleet (re)started: their next new pid is not a crash

    def start(self, endpoint: str, bundle: dict) -> None:
        self.endpoint = endpoint
        self.placed = {f"actor-{i}" for i in range(self.n)}
        self.pgs = [placement_group([bundle], strategy="PACK") for _ in range(self.n)]
        self.hosts = []
        for i, pg in enumerate(self.pgs):
            argv = ["-m", "cadence.launch.cli", "actor", "--connect", endpoint, "--id", f"actor-{i}"]
            self.hosts.append(self.Host.options(**self.host_options(pg)).remote(
                f"actor-{i}", argv, self.env, self.files, self.file_args))
        self.message(f"{self.n} actor processes placed (connecting to {endpoint})")

    def poll(self) -> None:
        refs = {f"actor-{i}": h.info.remote() for i, h in enumerate(self.hosts)}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=2.0)
        for i, (name, ref) in enumerate(refs.items()):
            if ref not in ready:  # being restarted by Ray, or busy
                self.infos.setdefault(name, {})["state"] = "no answer"
                continue
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError:
                self.infos.setdefault(name, {})["state"] = "dead"
                continue
            old = self.infos.get(name, {})
            if old.get("host_pid") not in (None, info["host_pid"]) or old.get("node_id") not in (None, info["node_id"]):
                self.restarts[name] = self.restarts.get(name, 0) + 1
                if name not in self.placed:  # Ray's restart, not our own new host
                    self.budget.restarted(name)
            self.placed.discard(name)
            info["state"] = "running" if info["exit"] is None else f"exited {info['exit']}"
            self.infos[name] = info
            self.logs.gather(name, self.hosts[i], info["host_pid"])

    def crash_loop(self) -> str | None:
        """Why the run must fail when an actor exceeded its restart budget (its last error from
        RUN_DIR/logs/NAME.log), else None."""
        name = self.budget.exceeded()
        if name is None:
            return None
        path = os.path.join(self.logs.dir, f"{name}.log")
        try:
            with open(path, errors="replace") as f:
                error = last_error(f.read())
        except FileNotFoundError:
            error = "(no output gathered)"
        b = self.budget
        return (f"{name} restarted more than {b.budget} times within {b.window_s:.0f} s (launch.actor_restart_budget,"
                f" launch.actor_restart_window_s): a crash loop. Its last error ({path}): {error}")

    def stop(self) -> None:
        for i, h in enumerate(self.hosts):
            name = f"actor-{i}"
            try:
                ray.get(h.stop.remote(10.0), timeout=20)
                self.logs.gather(name, h, self.infos.get(name, {}).get("host_pid"))  # its last words
                ray.get(h.close.remote(), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            ray.kill(h, no_restart=True)
        for pg in self.pgs:
            remove_placement_group(pg)
        self.hosts, self.pgs = [], []

    def status(self) -> dict:
        return {"processes": len(self.hosts), "endpoint": self.endpoint, "restarts": sum(self.restarts.values()),
                "hosts": [{"name": name, "restarts": self.restarts.get(name, 0),
                           **{k: inf.get(k) for k in ("state", "node_ip", "node_id", "pid")}}
                          for name, inf in sorted(self.infos.items())]}
