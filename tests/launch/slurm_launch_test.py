"""`cadence launch slurm` on a real one-node SLURM cluster (slurmctld, slurmd, munged from Debian's
packages, in a private network namespace; conftest.py's slurm_cluster), and its batch script.

Run with `python -m pytest -m slurm -rs tests/launch` (root; apt-get install slurm-wlm munge).
"""
import os
import subprocess

import pytest

from cadence.launch.cluster import launch_state
from cadence.launch.cluster.slurm.launcher import job_script
from cadence.launch.config import load_config
from tests.launch.ray_cluster import SHORT, finish, start_launch, status, stop_launch, wait_for


def test_job_script_asks_for_every_process_and_quotes_the_environment():
    cfg = load_config([], ["learner.processes=2", "actors.processes=3", "launch.learner_cpus=4",
                           "launch.actor_cpus=2", "launch.learner_gpus=8", "launch.actor_gpus=1",
                           "launch.env=[XLA_FLAGS=--a --b]"])
    text = job_script(cfg, "/shared/runs/r 1")
    assert "#SBATCH --ntasks=5\n" in text and "#SBATCH --cpus-per-task=4\n" in text
    assert "#SBATCH --gpus=19\n" in text and "#SBATCH --requeue\n" in text
    assert "export XLA_FLAGS='--a --b'\n" in text  # a value with spaces stays one word
    assert text.rstrip().endswith("-m cadence.launch.cluster.slurm.job '/shared/runs/r 1'")
    assert "#SBATCH --gpus" not in job_script(load_config([], ["actors.processes=1"]), "/r")


@pytest.mark.slurm
def test_learner_killed_then_the_job_requeued_the_run_goes_on_from_its_checkpoint(slurm_cluster, run_dir):
    env = slurm_cluster.env
    proc = start_launch("slurm", [], run_dir, *SHORT, "actors.processes=1", "run.steps=5000", env=env)

    def step():
        return status(run_dir).get("step") or 0

    def scontrol(*args):
        subprocess.run(["scontrol", *args], env=env, check=True, capture_output=True)

    ckpts = os.path.join(run_dir, "checkpoints")
    wait_for(lambda: os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts)) and
             status(run_dir)["actors"]["processes"] == 1, 900, "a checkpoint and an actor", proc)
    # 1. the learner's step is killed (kill -9 of its task): the driver restarts it from the checkpoint
    st = status(run_dir)
    subprocess.run(["scancel", "--signal=KILL", st["learner"]["hosts"][0]["step"]], env=env, check=True)
    wait_for(lambda: status(run_dir)["learner"]["restarts"] == 1 and status(run_dir)["actors"]["processes"] == 1
             and status(run_dir)["state"] == "running", 300, "the learner's restart", proc)
    s1 = step()
    wait_for(lambda: step() >= s1 + 3, 600, "steps after the learner's restart", proc)

    # 2. the whole job is requeued (as SLURM does when a node fails): it starts again and resumes
    job_id = st["slurm_job_id"]
    scontrol("requeue", job_id)
    wait_for(lambda: status(run_dir).get("launched_at", 0) > st["launched_at"] and
             status(run_dir)["state"] == "running", 600, "the requeued job to start", proc)
    s2 = step()
    wait_for(lambda: step() >= s2 + 3, 600, "steps in the requeued job", proc)

    stop_launch(run_dir, "slurm", env)
    summary = finish(proc, run_dir, timeout=600)
    assert summary["preempted"] and launch_state.read_status(run_dir, "slurm")["state"] == "stopped"
    assert summary["samples"] == 8 * summary["ledger"]["consumed"]  # the ledger verified at the end of train()
    assert len(summary["resumed_from"]) == 2  # after the learner's kill, and in the requeued job
    assert summary["steps"] >= s2 + 3


def test_rays_placement_resources_are_a_config_error_under_slurm(tmp_path, capsys):
    from cadence.launch.cli import main

    assert main(["launch", "slurm", "launch.actor_resources=[worker_node=1]", f"run.dir={tmp_path}/run"]) == 2
    assert "launch.actor_resources" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")  # nothing written, nothing submitted
