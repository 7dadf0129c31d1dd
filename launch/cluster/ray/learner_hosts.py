"""One start of the learner under Ray: its placement group, one host per process, their fate.

    group = LearnerGroup.start(Host, cfg, run_dir, size=2, wait=600.0, files=..., keys_dir=..., env=...,
                               message=print)          # None: no placement within `wait` seconds
    group.poll()             # (exit codes, indices of hosts that no longer answer)
    group.checkpoint_and_stop(deadline)                # SIGTERM to process 0: a final checkpoint
    group.end(logs)          # gather the output, kill the hosts, release the placement group

Process 0's node runs the jax.distributed coordinator and the dispatcher; every process is
`cadence train --config {dir}/config.yaml run.resume=auto ...` with the group in its environment.
A node that died a moment ago may still look placeable (its host never answers): the group is
then placed again.
"""
from __future__ import annotations

import time

import ray
from ray.util.placement_group import remove_placement_group

from cadence.launch.cluster.ray import placement
from cadence.learner import multihost

HOST_TIMEOUT_S = 120.0  # a placed host must answer within this (a loaded machine can be slow)
_LOST = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)


class LearnerGroup:
    def __init__(self, pg, hosts, size: int, started: float):
        self.pg, self.hosts, self.size, self.started = pg, hosts, size, started
        self.infos: list[dict] = []
        self.asked_to_stop = False  # our SIGTERM (a stop, or growing back): exit 0 is not "finished"
        self.ended = False

    @classmethod
    def start(cls, Host, cfg, run_dir: str, size: int, wait: float, *, files: dict, keys_dir: str, env: dict,
              message, stopping) -> "LearnerGroup | None":
        """`size` processes, or as many as fit (down to launch.min_learner_processes) after `wait`
        seconds; None when not even that many could be placed (or `stopping()` said to give up)."""
        launch = cfg.launch
        pg = placement.place(launch, size, wait)
        while pg is None and size > launch.min_learner_processes and not stopping():
            size -= 1  # elastic: continue on the capacity that is there
            pg = placement.place(launch, size, min(wait, 30.0) or 5.0)
        if pg is None:
            return None
        hosts = [Host.options(**placement.host_options(launch, "learner", pg, i, 0)).remote(
                 f"learner-{i}", None, None, files) for i in range(size)]
        try:
            return cls._start_processes(pg, hosts, size, cfg, run_dir, keys_dir, env, message)
        except _LOST as e:
            message(f"the learner group of {size} did not start ({type(e).__name__}); placing it again")
            for h in hosts:
                ray.kill(h, no_restart=True)
            remove_placement_group(pg)
            return cls.start(Host, cfg, run_dir, size, wait, files=files, keys_dir=keys_dir, env=env,
                             message=message, stopping=stopping)

    @classmethod
    def _start_processes(cls, pg, hosts, size, cfg, run_dir, keys_dir, env, message) -> "LearnerGroup":
        infos = ray.get([h.info.remote() for h in hosts], timeout=HOST_TIMEOUT_S)
        leader_ip = infos[0]["node_ip"]
        overrides = [f"run.dir={run_dir}", "run.resume=auto", "actors.processes=0", "actors.num_actors=0",
                     f"actors.listen=tcp://{leader_ip}:0", "learner.processes=1"]
        if cfg.launch.curve:
            overrides.append(f"actors.keys_dir={keys_dir}")  # on the run dir, which learner nodes see
        env = dict(env)
        if size > 1:
            port = ray.get(hosts[0].free_port.remote(), timeout=HOST_TIMEOUT_S)
            env.update({multihost.ENV_COORDINATOR: f"{leader_ip}:{port}", multihost.ENV_NUM_PROCESSES: str(size)})
        started = time.time()
        for i, h in enumerate(hosts):
            argv = ["-m", "cadence.launch.cli", "train", "--config", "{dir}/config.yaml", *overrides]
            # each process's weight server binds its own node's address (multihost.ENV_WEIGHTS_HOST)
            proc_env = {**env, multihost.ENV_PROCESS_ID: str(i),
                        multihost.ENV_WEIGHTS_HOST: infos[i]["node_ip"]} if size > 1 else env
            ray.get(h.start.remote(argv, proc_env), timeout=HOST_TIMEOUT_S)
        group = cls(pg, hosts, size, started)
        group.infos = ray.get([h.info.remote() for h in hosts], timeout=HOST_TIMEOUT_S)
        where = ", ".join(f"learner-{i}@{inf['node_ip']}" for i, inf in enumerate(group.infos))
        message(f"learner group of {size} placed: {where}")
        return group

    def poll(self) -> tuple[list, list[int]]:
        """Each process's exit code (None while it runs) and the indices of hosts that are gone."""
        refs = [h.poll.remote() for h in self.hosts]
        codes, lost = [], []
        for i, ref in enumerate(refs):
            try:
                codes.append(ray.get(ref, timeout=30))
            except _LOST:
                codes.append(None)
                lost.append(i)
        return codes, lost

    def signal_leader(self, signum: int) -> None:
        ray.get(self.hosts[0].signal.remote(signum), timeout=HOST_TIMEOUT_S)

    def checkpoint_and_stop(self, deadline: float) -> None:
        """SIGTERM to process 0: a final checkpoint, the others stopped by it, exit 0."""
        try:
            ray.get(self.hosts[0].stop.remote(deadline), timeout=deadline + 10)
            ray.get([h.stop.remote(30.0) for h in self.hosts[1:]], timeout=40)
        except _LOST:
            pass

    def gather_logs(self, logs) -> None:
        for i, h in enumerate(self.hosts):
            pid = self.infos[i]["host_pid"] if i < len(self.infos) else None
            logs.gather(f"learner-{i}", h, pid)

    def end(self, logs) -> None:
        """Gather the last output, kill the hosts, release the placement (once)."""
        if self.ended:
            return
        self.ended = True
        self.gather_logs(logs)
        for h in self.hosts:
            try:
                ray.get(h.stop.remote(2.0), timeout=10)
                ray.get(h.close.remote(), timeout=10)
            except _LOST:
                pass
            ray.kill(h, no_restart=True)
        remove_placement_group(self.pg)

    def status(self) -> list[dict]:
        return [{k: inf.get(k) for k in ("name", "node_ip", "node_id", "pid")} for inf in self.infos]

