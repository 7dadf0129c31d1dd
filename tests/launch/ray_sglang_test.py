"""`cadence launch ray actors.engine=sglang`: Ray places an actor process on the worker node and its
sglang-jax server runs beside it (launched by that process, with the resources Ray gave it); a kill -9
of the actor process takes its server along, Ray restarts the process, which starts a fresh server
caught up to the newest weights before it asks for work. Real two-node Ray cluster in a private
network namespace (as ray_launch_test.py), real sglang-jax server ($CADENCE_SGLANG_PYTHON)."""
import os
import signal
import time

import pytest

from cadence.actors.sglang.testing import SKIP_REASON, sglang_python
from cadence.launch.cluster import launch_state
from cadence.launch.metrics import read_metrics
from cadence.launch.cluster.ray.local_cluster import WORKER_RESOURCE
from tests.e2e.sglang_processes_test import living, servers_of
from tests.launch.ray_cluster import PLACE, finish, launch, node_ids, status, stop_launch, wait_for
from tests.proc_table import processes

pytestmark = [pytest.mark.ray, pytest.mark.sglang, pytest.mark.skipif(not sglang_python(), reason=SKIP_REASON)]

BATCH, G = 32, 8
SGLANG = ["learner.sft.steps=5", "run.eval_every=0", "run.progress=false", "task.num_digits=3",
          "task.heldout_size=16", "engine.max_new_tokens=4", "model.d_model=256", "model.n_heads=2",
          "model.n_kv_heads=2", "model.d_ff=256", "model.n_layers=1", f"learner.batch_size={BATCH}",
          f"learner.group_size={G}", "actors.prompts_per_call=4", "actors.max_staleness=2", "actors.engine=sglang",
          "actors.processes=1", f"actors.sglang.launch_python={sglang_python()}"]


def ancestors(pid) -> list[int]:
    procs, out = processes(), []
    while pid in procs and pid > 1:
        pid = procs[pid][0]
        out.append(pid)
    return out


def test_sglang_server_beside_its_actor_on_the_worker_node_and_back_after_kill9(cluster_up, run_dir):
    # its server's files under the run dir (the nodes share this machine's disk): servers_of finds them
    proc = launch(cluster_up, run_dir, *PLACE, *SGLANG, "run.steps=5000",  # ends with --stop
                  f"actors.sglang.work_dir={os.path.join(run_dir, 'sglang')}")

    def step():
        return status(run_dir).get("step") or 0

    st = wait_for(lambda: step() >= 2 and (s := status(run_dir)) and s["actors"]["hosts"][0].get("pid") and s,
                  1200, "step 2 with the actor", proc)
    nodes = node_ids(st)
    actor = st["actors"]["hosts"][0]
    assert actor["node_id"] == nodes[WORKER_RESOURCE]
    servers = wait_for(lambda: servers_of(run_dir), 300, "the actor's server", proc)
    # the server is the actor process's own: launched by it, on the node Ray placed it on
    assert all(actor["pid"] in ancestors(s) for s in servers), (actor, servers)
    members = set().union(*servers.values())

    os.kill(actor["pid"], signal.SIGKILL)
    deadline = time.time() + 60
    while living(members) and time.time() < deadline:
        time.sleep(0.5)
    assert not living(members), "the server outlived its actor process"
    wait_for(lambda: status(run_dir)["actors"]["restarts"] >= 1, 300, "Ray's restart of the actor", proc)
    new = wait_for(lambda: (h := status(run_dir)["actors"]["hosts"][0]).get("pid") not in (None, actor["pid"]) and h,
                   300, "the restarted actor", proc)
    wait_for(lambda: [s for s in servers_of(run_dir) if new["pid"] in ancestors(s)], 600,
             "the restarted actor's own server", proc)
    s0 = step()
    wait_for(lambda: step() >= s0 + 2, 1200, "steps with the new server", proc)

    stop_launch(run_dir)
    summary = finish(proc, run_dir, timeout=900)
    assert summary["preempted"] and launch_state.read_status(run_dir)["state"] == "stopped"
    assert summary["samples"] == G * summary["ledger"]["consumed"]  # the ledger verified at the end of train()
    rows = read_metrics(run_dir)
    assert rows[-1]["actors/groups/sglang"] >= summary["ledger"]["consumed"] and "actors/groups/jax" not in rows[-1]
    deadline = time.time() + 60
    while servers_of(run_dir) and time.time() < deadline:
        time.sleep(0.5)
    assert not servers_of(run_dir), "an SGLang server outlived the run"
