"""`cadence launch ray` with a learner of two hosts (one per node) and an actor process: each
learner process serves the pieces of the weights its devices hold from its own node's address
(learner/multihost.ENV_WEIGHTS_HOST), so process 0 sends half the model per transfer and the
actor assembles the rest from process 1 (a missing half fails the actor's weights check)."""
import pytest

from cadence.launch.config import load_config, preflight
from cadence.launch.cluster.ray.local_cluster import HEAD_RESOURCE
from cadence.launch.metrics import read_metrics
from cadence.learner import sharding
from cadence.learner.models.llama import abstract_params
from tests.launch.ray_cluster import SHORT, finish, launch

pytestmark = pytest.mark.ray


def test_two_learner_hosts_each_serve_their_own_pieces_to_actor_processes(cluster_up, run_dir):
    proc = launch(cluster_up, run_dir, *SHORT, "learner.processes=2", "launch.learner_strategy=STRICT_SPREAD",
                  f"launch.actor_resources=[{HEAD_RESOURCE}=0.1]", "actors.processes=1", "run.steps=6")
    summary = finish(proc, run_dir, timeout=1200)
    assert summary["steps"] == 6
    last = read_metrics(run_dir)[-1]
    whole = sharding.tree_bytes(abstract_params(preflight(load_config()).model)[1])
    assert last["actors/weights_sent"] >= 2, last
    assert last["actors/weights_sent_bytes"] == last["actors/weights_sent"] * whole // 2, last
