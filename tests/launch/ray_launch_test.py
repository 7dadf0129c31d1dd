"""`cadence launch ray` against a real two-node Ray cluster (real CLI, real processes, real kills).

Everything runs inside a private network namespace with only loopback (launch/cluster/ray/local_cluster.py): Ray
listens on all interfaces, and tests may only talk to loopback. The head node carries the
resource `head_node`, the worker node `worker_node`; the configs put the learner on the head and
the actors on the worker through launch.learner_resources / launch.actor_resources.
Run with `python -m pytest -m ray` (root needed for the namespace; .ci/run does it).
"""
import os
import shutil
import signal
import tempfile
import time

import pytest

from cadence.launch.cluster import launch_state
from cadence.launch.cluster.ray.local_cluster import HEAD_RESOURCE, WORKER_RESOURCE, listening_sockets
from tests.launch.ray_cluster import (PLACE, SHORT, _logs, finish, launch, node_ids, status, stop_launch,
                                       wait_for)

pytestmark = pytest.mark.ray


def test_sort6_to_target_learner_on_head_actors_on_worker(cluster_up, run_dir):
    proc = launch(cluster_up, run_dir, *PLACE, "actors.processes=2", "run.stop_at_exact_match=0.5",
                  "run.steps=800", "task.heldout_size=128", "run.progress=false")
    st = wait_for(lambda: (s := status(run_dir)) and len(s["actors"]["hosts"]) == 2 and
                  all(h["state"] == "running" for h in s["actors"]["hosts"]) and s, 600, "2 actors", proc)
    nodes = node_ids(st)
    assert [h["node_id"] for h in st["learner"]["hosts"]] == [nodes[HEAD_RESOURCE]]
    assert {h["node_id"] for h in st["actors"]["hosts"]} == {nodes[WORKER_RESOURCE]}
    # Ray and Cadence listen on loopback only (nothing else exists in this namespace either)
    local = [line.split()[3] for line in listening_sockets()]
    assert local and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in local), local
    summary = finish(proc, run_dir, timeout=1800)
    assert summary["target_reached_at"] is not None, summary
    assert summary["final_eval"]["eval/exact_match"] >= 0.5
    assert summary["samples"] == 8 * summary["ledger"]["consumed"]  # verified ledger: each prompt once
    assert summary["launch"]["learner_restarts"] == 0 and summary["launch"]["first_step_seconds"] > 0
    # every process's output is in the run directory; no secret key is in any log or command line
    logs = sorted(os.listdir(os.path.join(run_dir, "logs")))
    assert logs == ["actor-0.log", "actor-1.log", "learner-0.log"]
    assert "joined session" in open(os.path.join(run_dir, "logs", "actor-0.log")).read()
    text = _logs(run_dir) + open(os.path.join(run_dir, "command.txt")).read() + \
        open(os.path.join(os.path.dirname(run_dir), "driver.log")).read()
    keys = os.path.join(run_dir, "launch", "keys")
    for name in ("server.key_secret", "client.key_secret"):
        secret = [line.split('"')[1] for line in open(os.path.join(keys, name)) if "secret-key" in line][0]
        assert secret not in text
    assert oct(os.stat(keys).st_mode & 0o777) == "0o700"
    assert launch_state.read_status(run_dir)["state"] == "finished"


def test_kill_actor_kill_learner_lose_worker_node_ledger_clean(cluster_up, run_dir):
    # long enough never to finish by itself: the scenario ends with `--stop`
    proc = launch(cluster_up, run_dir, *PLACE, *SHORT, "actors.processes=2", "run.steps=5000",
                  "launch.elastic_timeout_s=5")

    def step():
        return status(run_dir).get("step") or 0

    st = wait_for(lambda: step() >= 3 and len(status(run_dir)["actors"]["hosts"]) == 2 and status(run_dir),
                  900, "step 3 with 2 actors", proc)
    # 1. kill -9 of an actor process: Ray restarts its host, the actor rejoins
    os.kill(st["actors"]["hosts"][0]["pid"], signal.SIGKILL)
    wait_for(lambda: status(run_dir)["actors"]["restarts"] >= 1, 300, "the actor's restart", proc)
    log0 = os.path.join(run_dir, "logs", "actor-0.log")
    wait_for(lambda: open(log0).read().count("joined session") >= 2, 600, "the restarted actor to rejoin", proc)
    s0 = step()
    wait_for(lambda: step() >= s0 + 3, 600, "steps after the actor restart", proc)

    # 2. kill -9 of the learner process (after a checkpoint): the group restarts from it
    ckpts = os.path.join(run_dir, "checkpoints")
    wait_for(lambda: os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts)), 600, "a checkpoint", proc)
    os.kill(status(run_dir)["learner"]["hosts"][0]["pid"], signal.SIGKILL)
    wait_for(lambda: status(run_dir)["learner"]["restarts"] == 1 and status(run_dir)["state"] == "running",
             300, "the learner's restart", proc)
    s1 = step()
    wait_for(lambda: step() >= s1 + 3, 900, "steps after the learner restart", proc)

    # 3. the worker node is lost (both actors with it) and comes back: actors re-placed, they rejoin
    restarts = status(run_dir)["actors"]["restarts"]
    cluster_up.kill_worker()
    time.sleep(5)
    cluster_up.start_worker()
    wait_for(lambda: status(run_dir)["actors"]["restarts"] >= restarts + 2, 600, "actors back on the worker", proc)
    s2 = step()
    wait_for(lambda: step() >= s2 + 3, 900, "steps with the actors back", proc)

    stop_launch(run_dir)
    summary = finish(proc, run_dir, timeout=600)
    assert summary["preempted"] and launch_state.read_status(run_dir)["state"] == "stopped"
    assert summary["steps"] >= s2 + 3
    assert summary["samples"] == 8 * summary["ledger"]["consumed"]  # the ledger verified at the end of train()
    assert len(summary["resumed_from"]) == 1 and summary["launch"]["learner_restarts"] == 1
    assert summary["launch"]["actor_restarts"] >= 3


def checkpoint_digest(run_dir, step) -> str:
    """SHA-256 of the params in RUN_DIR/checkpoints/STEP, restored here on one device."""
    from cadence.launch import artifacts
    from cadence.launch.config import load_config
    from cadence.learner.models.policy import build_policy
    from cadence.launch.run.recorder import arrays_of
    from cadence.learner.checkpoint import Checkpointer
    from cadence.learner.steps import make_train_step

    cfg = load_config([os.path.join(run_dir, "config.yaml")])
    policy = build_policy(cfg)
    template = arrays_of(make_train_step(policy.graphdef, cfg.learner).init(policy.params))
    only = tempfile.mkdtemp(prefix="ckpt-")
    try:  # a directory holding just that step: restore_latest restores it
        shutil.copytree(os.path.join(run_dir, "checkpoints", str(step)), os.path.join(only, str(step)))
        ckpt = Checkpointer(only, cfg.checkpoint)
        restored_step, arrays, _ = ckpt.restore_latest(template)
        ckpt.close()
        assert restored_step == step
        return artifacts.params_digest(arrays["params"])
    finally:
        shutil.rmtree(only, ignore_errors=True)


def test_elastic_learner_two_processes_lose_one_continue_on_one(cluster_up, run_dir):
    # one learner process per node (STRICT_SPREAD), the actor on the head; the worker node is lost
    # and does not come back: after launch.elastic_timeout_s the group continues on one process
    proc = launch(cluster_up, run_dir, "learner.processes=2", "launch.learner_strategy=STRICT_SPREAD",
                  f"launch.actor_resources=[{HEAD_RESOURCE}=0.1]", "actors.processes=1",
                  "launch.elastic_timeout_s=5", "launch.grow_check_s=0", "run.resume_digest=true",
                  "checkpoint.every_steps=10", "checkpoint.keep=100", "run.stop_at_exact_match=0.5",
                  "run.steps=800", "task.heldout_size=128", "run.progress=false")
    st = wait_for(lambda: (s := status(run_dir)) and (s.get("step") or 0) >= 12 and s, 1500, "step 12", proc)
    assert st["learner"]["processes"] == 2
    assert len({h["node_id"] for h in st["learner"]["hosts"]}) == 2  # one per node
    cluster_up.kill_worker()
    wait_for(lambda: status(run_dir)["learner"]["processes"] == 1 and status(run_dir)["state"] == "running",
             600, "the group on one process", proc)
    summary = finish(proc, run_dir, timeout=2400)
    assert summary["target_reached_at"] is not None and summary["final_eval"]["eval/exact_match"] >= 0.5
    assert summary["samples"] == 8 * summary["ledger"]["consumed"]
    assert summary["launch"]["shrinks"] and summary["launch"]["shrinks"][0]["processes"] == 1
    resumed = summary["resumed_from"][-1]
    assert resumed["learner_processes"] == 1
    # the params the one process resumed with are bit for bit the two processes' checkpoint
    assert resumed["params_sha256"] == checkpoint_digest(run_dir, resumed["step"])
