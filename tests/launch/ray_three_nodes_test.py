"""A learner spread over three Ray nodes (one process on each) loses a node, continues on the two
left, and grows back to three when the node returns: issue 30's acceptance run, on a real Ray
cluster of a head and two worker nodes on this machine.
Run with `python -m pytest -m ray` (root needed for the private network namespace)."""
import pytest

from cadence.launch.cluster.private_network import enter_private_network
from cadence.launch.cluster.ray.local_cluster import HEAD_RESOURCE, LocalCluster
from cadence.launch.metrics import read_metrics
from tests.launch.ray_cluster import SHORT, finish, launch, status, stop_launch, wait_for

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def three_nodes():
    enter_private_network()
    with LocalCluster(cpus=2, workers=2) as c:
        yield c


def test_a_learner_on_three_nodes_continues_on_two_and_grows_back_to_three(three_nodes, run_dir):
    # STRICT_SPREAD: one learner process per node, so losing a node leaves room for two
    proc = launch(three_nodes, run_dir, *SHORT, "learner.processes=3", "launch.learner_cpus=1",
                  "launch.learner_strategy=STRICT_SPREAD", f"launch.actor_resources=[{HEAD_RESOURCE}=0.1]",
                  "launch.actor_cpus=0.5", "actors.processes=1", "run.steps=5000",
                  "launch.elastic_timeout_s=5", "launch.grow_check_s=3", "checkpoint.every_steps=2",
                  "run.resume_digest=true")

    def at(processes):
        s = status(run_dir)
        return s.get("state") == "running" and s["learner"]["processes"] == processes and (s.get("step") or 0)

    wait_for(lambda: (at(3) or 0) >= 3, 1200, "step 3 on 3 processes", proc)
    three_nodes.kill_worker(1)
    s0 = wait_for(lambda: at(2), 900, "a step on 2 processes", proc)
    wait_for(lambda: (at(2) or 0) >= s0 + 2, 900, "steps on 2 processes", proc)
    three_nodes.start_worker(1)  # the node returns: the group grows back to 3
    s1 = wait_for(lambda: at(3), 900, "a step on 3 processes again", proc)
    wait_for(lambda: (at(3) or 0) >= s1 + 2, 900, "steps on 3 processes again", proc)
    stop_launch(run_dir)
    summary = finish(proc, run_dir, timeout=600)
    assert summary["samples"] == 8 * summary["ledger"]["consumed"]
    assert [r["learner_processes"] for r in summary["resumed_from"]][-2:] == [2, 3]
    assert summary["launch"]["learner_restarts"] == 1 and summary["launch"]["shrinks"][0]["processes"] == 2
    assert max(r["step"] for r in read_metrics(run_dir) if "batch_size" in r) >= s1 + 2
