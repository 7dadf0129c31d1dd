"""`cadence train actors.engine=sglang actors.processes=1`: an actor process drives sglang-jax servers
of its own (launch/cluster/actor_process.py), fed by the learner's weight server; real servers, real signals.

Weight sync is a server restart (sglang-jax), so with actors.max_staleness=2 the process restarts its
server about every 3 versions and the groups' policy versions advance. Needs $CADENCE_SGLANG_PYTHON
(see tests/actors/sglang_engine_test.py). Each server start is 15-60 s on a 2-core machine.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cadence.actors.sglang.testing import SKIP_REASON, sglang_python
from cadence.launch.metrics import read_metrics
from tests.proc_table import processes
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.skipif(not sglang_python(), reason=SKIP_REASON)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH, G = 32, 8


def args(run, steps):
    return [f"run.dir={run}", f"run.steps={steps}", "run.eval_every=0", "run.progress=false",
            "learner.sft.steps=5", "task.num_digits=3", "task.heldout_size=16", "engine.max_new_tokens=4",
            "model.d_model=256", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=256", "model.n_layers=1",
            f"learner.batch_size={BATCH}", f"learner.group_size={G}", "actors.prompts_per_call=4",
            "actors.max_staleness=2", "actors.restart_backoff_seconds=0.2", "actors.engine=sglang",
            "actors.processes=1", f"actors.sglang.launch_python={sglang_python()}"]


@pytest.fixture
def train():
    """Starts `cadence train`; one still running at the test's end gets SIGTERM (it stops its actors)."""
    started = []

    def start(*argv):
        env = dict(os.environ, PYTHONPATH=ROOT)
        started.append(subprocess.Popen([sys.executable, "-m", "cadence.launch.cli", "train", *argv],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        return started[-1]

    yield start
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()


def living(pids) -> set[int]:
    procs = processes()
    return {p for p in pids if p in procs and procs[p][3] != "Z"}  # a zombie holds no port or memory


def servers_of(run) -> dict[int, set[int]]:
    """{server pid: every process of its group} of the sglang-jax servers serving a checkpoint under run
    (the group: its watcher, the server and the workers it started)."""
    procs = processes()
    roots = [p for p, (_, _, argv, state) in procs.items()
             if state != "Z" and argv[1:3] == ["-m", "sgl_jax.launch_server"] and any(str(run) in a for a in argv)]
    return {root: {p for p, (_, pgid, _, state) in procs.items() if pgid == procs[root][1] and state != "Z"}
            for root in roots}


def port_of(pid) -> int:
    argv = processes()[pid][2]
    return int(argv[argv.index("--port") + 1])


def listening(port) -> bool:
    """Does any socket listen on this TCP port (TIME_WAIT leftovers do not count)?"""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        if any(int(r.split()[1].rsplit(":", 1)[1], 16) == port and r.split()[3] == "0A" for r in rows):
            return True
    return False


def serving(run) -> dict[int, set[int]] | None:
    """servers_of(run) once its one server listens."""
    servers = servers_of(run)
    try:
        return servers if len(servers) == 1 and listening(port_of(next(iter(servers)))) else None
    except (KeyError, ValueError):  # it exited meanwhile
        return None


def actor_pid(learner) -> int | None:
    for pid, (ppid, _, argv, state) in processes().items():
        if ppid == learner.pid and "actor" in argv and state != "Z":
            return pid
    return None


def rows(run):
    return read_metrics(str(run)) if os.path.exists(os.path.join(run, "metrics.jsonl")) else []


def finish(learner, run, steps):
    out, err = learner.communicate(timeout=1800)
    assert learner.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == steps
    # ledger.verify() at the end of train(): every prompt handed out is in exactly one state
    assert summary["ledger"]["in_flight"] == 0 and summary["ledger"]["consumed"] == steps * BATCH // G
    deadline = time.time() + 30  # the actor process stops its servers as it leaves
    while servers_of(run) and time.time() < deadline:
        time.sleep(0.5)
    assert not servers_of(run), "an SGLang server outlived the run"
    return summary, rows(run)


def newest_version(row) -> int:
    """The newest policy version among the step's samples (its smallest staleness)."""
    return row["step"] - 1 - next(i for i, n in enumerate(row["staleness/hist"]) if n)


def test_an_actor_process_drives_its_own_sglang_server_and_versions_advance(tmp_path, train):
    run, steps = tmp_path / "run", 8
    summary, ms = finish(train(*args(run, steps)), run, steps)
    last = ms[-1]
    assert last["actors/groups/sglang"] >= steps * BATCH // G and "actors/groups/jax" not in last
    assert max(newest_version(r) for r in ms[1:]) > 0  # the restarts brought newer weights to the server
    assert max(r["staleness/max"] for r in ms[1:]) <= 2
    # the process's engine counters reach the learner's metrics through its heartbeats
    assert max(r.get("actor/proc-0/sglang/syncs", 0) for r in ms) >= 2
    assert "sglang/syncs" not in last  # the learner launched no servers of its own
    logs = os.listdir(run / "sglang" / "proc-0" / "logs")
    assert logs, "no server log in the process's work dir"


def test_kill9_of_the_actor_process_takes_its_server_and_the_restart_catches_up(tmp_path, train):
    run, steps = tmp_path / "run", 10
    learner = train(*args(run, steps))
    wait_for(lambda: any(r["step"] >= 3 for r in rows(run)), proc=learner, timeout=900, what="step 3")
    old_actor = wait_for(lambda: actor_pid(learner), proc=learner, timeout=900, what="the actor process")
    (server, _), = wait_for(lambda: serving(run), proc=learner, timeout=900, what="its server, listening").items()
    port = port_of(server)  # kept across the restarts of a weight sync
    members = set().union(*servers_of(run).values())  # a sync may have restarted the server meanwhile
    os.kill(old_actor, signal.SIGKILL)
    gone = time.time() + 30
    while (living(members) or listening(port)) and time.time() < gone:
        time.sleep(0.2)
    assert not living(members), "the server or a worker outlived its actor process (orphan)"
    assert not listening(port), "its port is still held"
    new_actor = wait_for(lambda: (p := actor_pid(learner)) not in (None, old_actor) and p, proc=learner,
                         timeout=900, what="the restarted actor process")
    new_server = wait_for(lambda: [p for p in servers_of(run) if p != server], proc=learner, timeout=900,
                          what="its new server")[0]
    watcher = processes()[new_server][1]
    assert processes()[watcher][0] == new_actor  # launched by the restarted process itself
    summary, ms = finish(learner, run, steps)
    last = ms[-1]
    assert last["actors/restarts"] >= 1 and last["actors/groups/sglang"] >= steps * BATCH // G
    assert max(newest_version(r) for r in ms[1:]) > 0
    with open(run / "actors" / "proc-0.log") as f:
        assert f.read().count("SGLang servers:") >= 2  # the restarted process launched its own


def test_the_sglang_actor_process_runs_the_held_out_evaluation(tmp_path, train):
    """run.eval_on=actors: the actor process evaluates with its SGLang server, brought to exactly the
    version evaluated, greedily; the numbers are the built-in engine's on the same weights (within
    one held-out prompt of 16, for a greedy tie the two engines may break apart)."""
    import cadence
    from cadence.launch.evaluate import evaluate

    run, steps = tmp_path / "run", 3
    summary, ms = finish(train(*args(run, steps), "run.eval_on=actors"), run, steps)
    evals = [m for m in ms if "eval/reward" in m]
    assert [m["step"] for m in evals] == [0, 3] and all("eval/generate_seconds" in m for m in evals)
    mine = evaluate(cadence.load_config([str(run / "config.yaml")]), str(run)).metrics
    theirs = summary["final_eval"]
    for key in ("eval/reward", "eval/exact_match"):
        assert abs(theirs[key] - mine[key]) <= 1 / 16 + 1e-9, (theirs, mine)
    assert theirs["eval/reward_errors"] == 0
