"""The elastic launch against a real two-node Ray cluster: a learner of 4 processes that loses a
node continues on 3 (a mesh its microbatch does not split over: rows re-planned, batch refit) and
grows back to 4; the grow probe asks for what the group's own placement strategy needs; an actor
process in a crash loop ends the run with its last error instead of being restarted forever while
the learner starves.
Run with `python -m pytest -m ray` (root needed for the private network namespace)."""
import os

import pytest

# The fast suite runs without the `ray` extra: collecting this file there must not need it.
ray = pytest.importorskip("ray")
from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, remove_placement_group  # noqa: E402

from cadence.launch.cluster import launch_state
from cadence.launch.cluster.ray import placement
from cadence.launch.cluster.ray.local_cluster import HEAD_RESOURCE, WORKER_RESOURCE
from cadence.launch.config import LaunchConfig
from tests import waiting
from cadence.launch.metrics import read_metrics
from tests.launch.ray_cluster import PLACE, SHORT, finish, launch, status, stop_launch, wait_for

pytestmark = pytest.mark.ray


def _alive(resource: str) -> str | None:
    return next((n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]), None)


def test_the_grow_probe_places_as_the_learner_group_does(cluster_up):
    ray.init(address=cluster_up.address, namespace="cadence-probe", log_to_driver=False, logging_level="WARNING",
             configure_logging=False)
    group = None
    try:
        spread = LaunchConfig(learner_strategy="STRICT_SPREAD")  # one learner process per node
        head = _alive(HEAD_RESOURCE)
        # a group shrunk to one process, on the head (which has room for another bundle)
        group = placement_group([placement.bundle(spread, "learner")], strategy="STRICT_SPREAD",
                                bundle_label_selector=[{NODE_ID_LABEL_KEY: head}])
        assert ray.wait([group.ready()], timeout=60)[0]
        assert placement.capacity_free(spread, 1, [head])  # the worker node can take the second
        cluster_up.kill_worker()
        waiting.wait_for(lambda: _alive(WORKER_RESOURCE) is None, 120, "Ray to see the worker node gone")
        # room beside the group's own process is no room for a STRICT_SPREAD group (a PACK probe said
        # yes here: the group restarted on 2, could not place, and shrank again)
        assert not placement.capacity_free(spread, 1, [head])
        assert placement.capacity_free(LaunchConfig(learner_strategy="SPREAD"), 1, [head])  # soft: anywhere
        pack = LaunchConfig(learner_strategy="STRICT_PACK")  # the group's node holds 2 bundles of 1 CPU
        assert placement.capacity_free(pack, 1, [head])
        assert not placement.capacity_free(pack, 2, [head])  # 3 on one node: neither node has the CPUs
        cluster_up.start_worker()
        waiting.wait_for(lambda: placement.capacity_free(spread, 1, [head]), 120, "the worker node's capacity")
    finally:
        if group is not None:
            remove_placement_group(group)
        ray.shutdown()


def test_an_actor_in_a_crash_loop_fails_the_run_with_its_last_error(cluster_up, run_dir):
    # a real fault only the actor processes have: a Python that cannot find its standard library
    proc = launch(cluster_up, run_dir, *PLACE, *SHORT, "actors.processes=1", "run.steps=5000",
                  "launch.actor_env=[PYTHONHOME=/nonexistent]", "launch.actor_restart_budget=2",
                  "launch.actor_restart_window_s=600")
    proc.communicate(timeout=900)  # without the budget: restarted forever, the learner waiting
    driver = open(os.path.join(os.path.dirname(run_dir), "driver.log")).read()
    assert proc.returncode == 1, driver[-3000:]
    assert "actor-0 restarted more than 2 times within 600 s" in driver and "crash loop" in driver, driver[-3000:]
    assert "ModuleNotFoundError: No module named 'encodings'" in driver  # its own error, from its log
    status = launch_state.read_status(run_dir)
    assert status["state"] == "failed" and "crash loop" in status["failure"]
    assert status["learner"]["restarts"] == 0  # the learner was not blamed


def test_a_learner_of_four_continues_on_three_and_grows_back_to_four(cluster_up, run_dir):
    # (it replaced a 2 -> 1 -> 2 run: the same loss, restart and growth, at a mesh that divides)
    # two learner processes per node (half a CPU each), the actor on the head: the worker node's loss
    # leaves room for three on the head, a mesh the 32-row microbatch does not split over
    proc = launch(cluster_up, run_dir, *SHORT, "learner.processes=4", "launch.learner_cpus=0.5",
                  "launch.learner_strategy=SPREAD", f"launch.actor_resources=[{HEAD_RESOURCE}=0.1]",
                  "launch.actor_cpus=0.5", "actors.processes=1", "learner.batch_size=32", "run.steps=5000",
                  "launch.elastic_timeout_s=5", "launch.grow_check_s=3", "checkpoint.every_steps=2",
                  "run.resume_digest=true")

    def at(processes):
        s = status(run_dir)
        return s.get("state") == "running" and s["learner"]["processes"] == processes and (s.get("step") or 0)

    wait_for(lambda: (at(4) or 0) >= 3, 1200, "step 3 on 4 processes", proc)
    cluster_up.kill_worker()
    s0 = wait_for(lambda: at(3), 900, "a step on 3 processes", proc)
    wait_for(lambda: (at(3) or 0) >= s0 + 2, 900, "steps on 3 processes", proc)
    cluster_up.start_worker()  # capacity returns: the group grows back to 4
    s1 = wait_for(lambda: at(4), 900, "a step on 4 processes again", proc)
    wait_for(lambda: (at(4) or 0) >= s1 + 2, 900, "steps on 4 processes again", proc)
    stop_launch(run_dir)
    summary = finish(proc, run_dir, timeout=600)
    assert summary["samples"] == 8 * summary["ledger"]["consumed"]
    assert [r["learner_processes"] for r in summary["resumed_from"]][-2:] == [3, 4]
    assert summary["launch"]["learner_restarts"] == 1 and summary["launch"]["shrinks"][0]["processes"] == 3
    rows = read_metrics(run_dir)
    decisions = [r["controller/decision"] for r in rows if r.get("controller/decision")]
    assert any("refit B 32 -> 24" in d for d in decisions) and "refit B 24 -> 32" in decisions[-1], decisions
    assert {r["batch_size"] for r in rows if "batch_size" in r} == {32, 24} and rows[-1]["batch_size"] == 32
