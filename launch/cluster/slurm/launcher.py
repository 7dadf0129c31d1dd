"""`cadence launch slurm`: the Launcher (launch/cluster/launcher.py) for a SLURM cluster.

    cadence launch slurm --sbatch=--partition=gpu --sbatch=--time=24:00:00 run.dir=/shared/runs/r1 \
        learner.processes=2 launch.learner_gpus=8 actors.processes=16 launch.actor_gpus=1
    cadence launch slurm --detach ...     # submit and return: {"slurm_job_id": ..., "run_dir": ...}
    SlurmLauncher(cfg, run_dir, sbatch_args=["--partition=gpu"]).run()   # the same, from Python

Writes the run's config and CurveZMQ keys (launch.curve) into RUN_DIR/launch/ (the run
directory must be on a file system every node sees), a batch script RUN_DIR/launch/job.sh
(`--ntasks` = learner + actor processes, `--cpus-per-task` the larger of launch.learner_cpus
and launch.actor_cpus, `--requeue`, SIGTERM to the driver before the time limit), submits it
with sbatch and follows the job until it ends: the run's summary, with a "launch" entry, is the
last line of stdout, the driver's exit status is this command's. Inside the job,
slurm/job.py places and restarts the processes as srun steps. sbatch options on the command line
(`--sbatch=...`, or SBATCH_* variables) win over the script's. Ray's placement keys
(launch.*_resources, learner_strategy, elastic_timeout_s, min_learner_processes, grow_check_s,
place_timeout_s) have no meaning here: the allocation is what sbatch grants.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import signal
import sys
import time

import yaml

from cadence._root import IMPORT_ROOT
from cadence.launch.cluster import launch_state
from cadence.launch.cluster.launcher import Launcher, LauncherUnavailable
from cadence.launch.cluster.slurm import steps as slurm
from cadence.launch.cluster.slurm.job import config_path

JOB_FILE = "slurm_job.json"
FOLLOW_S = 2.0


def job_script(cfg, run_dir: str) -> str:
    la = cfg.launch
    learners, actors = cfg.learner.processes, cfg.actors.processes
    cpus = max(math.ceil(la.learner_cpus), math.ceil(la.actor_cpus) if actors else 0, 1)
    gpus = math.ceil(la.learner_gpus) * learners + math.ceil(la.actor_gpus) * actors
    name = os.path.basename(run_dir.rstrip("/")) or "run"
    stop_after = int(cfg.checkpoint.signal_timeout_seconds + 60)
    lines = ["#!/bin/bash", f"#SBATCH --job-name=cadence-{name}", f"#SBATCH --ntasks={learners + actors}",
             f"#SBATCH --cpus-per-task={cpus}", f"#SBATCH --output={run_dir}/logs/slurm-%j.log",
             "#SBATCH --open-mode=append", "#SBATCH --requeue", f"#SBATCH --signal=B:TERM@{stop_after}"]
    if gpus:
        lines.append(f"#SBATCH --gpus={gpus}")
    path = os.pathsep.join(p for p in (IMPORT_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    lines.append(f"export PYTHONPATH={shlex.quote(path)}")
    lines += [f"export {k}={shlex.quote(v)}" for k, _, v in (e.partition("=") for e in la.env)]
    lines.append(f"exec {shlex.quote(sys.executable)} -m cadence.launch.cluster.slurm.job {shlex.quote(run_dir)}")
    return "\n".join(lines) + "\n"


def _job_id(run_dir: str) -> str:
    try:
        with open(os.path.join(launch_state.launch_dir(run_dir), JOB_FILE)) as f:
            return json.load(f)["job_id"]
    except (FileNotFoundError, ValueError, KeyError):
        return ""


class SlurmLauncher(Launcher):
    kind = "slurm"
    help = "the run as one SLURM batch job (sbatch; srun steps; restarts inside the job and by --requeue)"

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                            help="an sbatch option, e.g. --sbatch=--partition=gpu (repeatable)")
        parser.add_argument("--detach", action="store_true", help="submit and return (follow with --status)")

    @classmethod
    def check_config(cls, cfg) -> None:
        from cadence.launch.config_loader import ConfigError

        for key in ("learner_resources", "actor_resources"):
            if getattr(cfg.launch, key):
                raise ConfigError(f"launch.{key}: Ray's custom resources mean nothing to SLURM; ask sbatch "
                                  "for what the job needs, e.g. --sbatch=--gres=gpu:8 or --sbatch=--constraint=NAME")
        if cfg.launch.actor_env:
            raise ConfigError("launch.actor_env: not honoured under SLURM yet; use launch.env (every process)")

    @classmethod
    def from_args(cls, cfg, run_dir, args) -> "SlurmLauncher":
        return cls(cfg, run_dir, sbatch_args=args.sbatch, detach=args.detach)

    def __init__(self, cfg, run_dir: str, sbatch_args: list[str] = (), detach: bool = False, message=None):
        self.cfg, self.run_dir = cfg, os.path.abspath(run_dir)
        self.sbatch_args, self.detach = list(sbatch_args), detach
        self.message = message or (lambda text: print(f"cadence launch: {text}", file=sys.stderr, flush=True))

    def run(self) -> int:
        d = launch_state.launch_dir(self.run_dir)
        os.makedirs(d, exist_ok=True)
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        launch_state.clear_stop(self.run_dir)
        from cadence.launch.config_loader import to_dict

        with open(config_path(self.run_dir), "w") as f:
            yaml.safe_dump(to_dict(self.cfg), f, sort_keys=False)
        if self.cfg.launch.curve:
            launch_state.write_keys(self.run_dir)
        script = os.path.join(d, "job.sh")
        with open(script, "w") as f:
            f.write(job_script(self.cfg, self.run_dir))
        try:
            job_id = slurm.submit(script, self.sbatch_args)
        except slurm.SlurmError as e:
            raise LauncherUnavailable(str(e)) from None
        with open(os.path.join(d, JOB_FILE), "w") as f:
            json.dump({"job_id": job_id, "submitted_at": time.time()}, f)
        launch_state.write_status(self.run_dir, {"state": "starting", "updated_at": time.time(),
                                                 "slurm_job_id": job_id, "learner": {}, "actors": {}})
        self.message(f"submitted SLURM job {job_id} (output: {self.run_dir}/logs/slurm-{job_id}.log)")
        if self.detach:
            print(json.dumps({"slurm_job_id": job_id, "run_dir": self.run_dir}), flush=True)
            return 0
        return self._follow(job_id)

    def _follow(self, job_id: str) -> int:
        """Until the job ends; SIGINT/SIGTERM ask it to stop (a second one cancels it)."""
        asked = []

        def on_signal(*_):
            asked.append(1)
            if len(asked) == 1:
                self.message("stopping the job cleanly (again to cancel it)")
                launch_state.request_stop(self.run_dir, self.kind)
                if slurm.job_state(job_id).get("JobState") == "PENDING":
                    slurm.cancel(job_id)
            else:
                slurm.cancel(job_id)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                try:
                    state = slurm.job_state(job_id)
                except slurm.SlurmError as e:  # slurmctld busy or restarting: the job goes on
                    self.message(str(e))
                    state = {"JobState": "UNKNOWN"}
                if not state or state.get("JobState") in slurm.ENDED:
                    break
                time.sleep(FOLLOW_S)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        code = int(state.get("ExitCode", "1:0").split(":")[0]) if state else 1
        if state.get("JobState") != "COMPLETED":
            self.message(f"SLURM job {job_id} ended {state.get('JobState', '(forgotten)')} "
                         f"({state.get('Reason', '')}); see {self.run_dir}/logs/slurm-{job_id}.log")
            code = code or 1
        self._print_summary()
        return code

    def _print_summary(self) -> None:
        path = os.path.join(self.run_dir, "summary.json")
        try:
            st = launch_state.read_status(self.run_dir, self.kind)
        except (FileNotFoundError, ValueError):
            return
        if os.path.isfile(path) and st.get("state") in ("finished", "stopped"):
            with open(path) as f:
                summary = json.load(f)
            summary["launch"] = st.get("launch", {})
            print(json.dumps(summary), flush=True)

    @classmethod
    def status(cls, run_dir: str) -> dict:
        st = launch_state.read_status(run_dir, cls.kind)
        job_id = _job_id(run_dir)
        if job_id:
            try:
                job = slurm.job_state(job_id)
                st["slurm"] = {"job_id": job_id, "state": job.get("JobState", "(forgotten)"),
                               "reason": job.get("Reason"), "nodes": job.get("NodeList")}
            except slurm.SlurmError as e:  # not on a SLURM node: the driver's file is still the status
                st["slurm"] = {"job_id": job_id, "error": str(e)}
        return st

    @classmethod
    def stop(cls, run_dir: str) -> str:
        path = launch_state.request_stop(run_dir, cls.kind)
        job_id = _job_id(run_dir)
        try:  # a job still waiting for its allocation has no driver to read the file
            if job_id and slurm.job_state(job_id).get("JobState") == "PENDING":
                slurm.cancel(job_id)
        except slurm.SlurmError:
            pass
        return path
