"""Actor processes through the real CLI: real processes, real sockets on 127.0.0.1, real signals.

kill -9 of an actor process mid-run, an actor that joins mid-run and leaves on SIGTERM, an actor
frozen past its heartbeat timeout, a learner SIGTERM and resume while outside actors stay up: the
run finishes and its ledger proves that no prompt was lost or consumed twice."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from cadence.launch.metrics import read_metrics
from tests.proc_table import processes
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["learner.sft.steps=10", "task.heldout_size=32", "run.eval_every=20", "run.progress=false",
        "actors.heartbeat_seconds=0.25", "actors.heartbeat_timeout_seconds=3", "actors.restart_backoff_seconds=0.2"]


def cli(*args, wait=False):
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "cadence.launch.cli", *args]
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    return read_metrics(run_dir) if os.path.exists(path) else []


def step_at_least(run_dir, n):
    return lambda: [m for m in rows(run_dir) if m["step"] >= n]


def actor_pids(parent: int) -> dict:
    """{actor_id: pid} of `cadence actor` children of the learner process."""
    return {argv[argv.index("--id") + 1]: pid for pid, (ppid, _, argv, _) in processes().items()
            if ppid == parent and "actor" in argv and "--id" in argv}


def finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kill9_of_an_actor_process_and_an_actor_joining_and_leaving_lose_nothing(tmp_path):
    run = str(tmp_path / "run")
    learner = cli("train", *BASE, f"run.dir={run}", "run.steps=150", "actors.processes=2")
    wait_for(step_at_least(run, 10), proc=learner, what="step 10")
    pids = wait_for(lambda: (p := actor_pids(learner.pid)) and len(p) == 2 and p, proc=learner, what="2 actors")
    os.kill(pids["proc-0"], signal.SIGKILL)  # mid-run, probably mid-generation
    wait_for(lambda: actor_pids(learner.pid).get("proc-0") not in (None, pids["proc-0"]), proc=learner,
               what="proc-0 restarted")
    with open(os.path.join(run, "endpoint.json")) as f:
        endpoint = json.load(f)["dispatch"]
    extra = cli("actor", "--connect", endpoint, "--id", "extra")
    wait_for(lambda: any(m.get("actors/alive") == 3 for m in rows(run)), proc=learner, what="3 actors alive")
    wait_for(lambda: any(m.get("actor/extra/samples_per_second", 0) > 0 for m in rows(run)), proc=learner,
               what="the joining actor contributes")
    extra.send_signal(signal.SIGTERM)
    _, err = extra.communicate(timeout=60)
    assert extra.returncode == 0 and "left (stopped)" in err, err
    summary = finish(learner)
    assert summary["steps"] == 150
    # summary["ledger"] is LedgerVerify's result: every prompt handed out is in exactly one state
    assert summary["ledger"]["in_flight"] == 0 and summary["ledger"]["consumed"] == 150 * 128 // 8
    last = rows(run)[-1]
    assert last["actors/restarts"] >= 1 and last["actors/joined"] >= 4 and last["actors/gone"] >= 2
    alive = [m["actors/alive"] for m in rows(run) if "actors/alive" in m]
    assert 3 in alive and alive[-1] == 2
    with open(os.path.join(run, "actors", "proc-0.log")) as f:
        assert f.read().count("joined session") >= 2


def test_a_frozen_actor_is_declared_gone_and_its_prompts_reissued(tmp_path):
    run = str(tmp_path / "run")
    learner = cli("train", *BASE, f"run.dir={run}", "run.steps=80", "actors.processes=2")
    wait_for(step_at_least(run, 5), proc=learner, what="step 5")
    pids = wait_for(lambda: (p := actor_pids(learner.pid)) and len(p) == 2 and p, proc=learner, what="2 actors")
    os.kill(pids["proc-1"], signal.SIGSTOP)  # alive but silent: no heartbeats
    wait_for(lambda: any(m.get("actors/gone", 0) >= 1 for m in rows(run)), proc=learner, timeout=120,
               what="proc-1 declared gone")
    os.kill(pids["proc-1"], signal.SIGCONT)  # it wakes up, is told it is unknown, and rejoins
    summary = finish(learner)
    assert summary["ledger"]["in_flight"] == 0 and summary["ledger"]["consumed"] == 80 * 128 // 8
    last = rows(run)[-1]
    assert last["actors/alive"] == 2 and last["actors/joined"] >= 3


def test_learner_sigterm_and_resume_while_actors_outside_stay_up(tmp_path):
    run = str(tmp_path / "run")
    port = free_port()
    common = [*BASE, f"run.dir={run}", "run.steps=60", "actors.num_actors=0", f"actors.listen=tcp://127.0.0.1:{port}",
              "checkpoint.every_steps=10"]
    learner = cli("train", *common)
    actors = [cli("actor", "--connect", f"tcp://127.0.0.1:{port}", "--id", f"outside-{i}") for i in range(2)]
    wait_for(step_at_least(run, 25), proc=learner, what="step 25")
    learner.send_signal(signal.SIGTERM)
    _, err = learner.communicate(timeout=120)
    assert learner.returncode == 0, err
    stopped = rows(run)[-1]["step"]
    assert stopped < 60
    time.sleep(2)
    assert all(a.poll() is None for a in actors)  # they wait for the learner to come back
    resumed = cli("train", "--resume", f"run.dir={run}")
    summary = finish(resumed)
    assert summary["steps"] == 60 and summary["resumed_from"][-1]["step"] == stopped
    assert summary["ledger"]["in_flight"] == 0 and summary["ledger"]["consumed"] == 60 * 128 // 8
    after = [m for m in rows(run) if m["step"] > stopped]
    assert after and max(m["actors/alive"] for m in after) == 2
    for a in actors:  # a finished run tells them to go home
        _, err = a.communicate(timeout=60)
        assert a.returncode == 0 and "left (finished)" in err and err.count("joined session") >= 2, err


@pytest.mark.parametrize("eval_on", ["auto", "actors"])  # auto: the learner's engine (one device)
def test_two_actor_processes_learn_sort6(tmp_path, eval_on):
    run = str(tmp_path / "run")
    out = cli("train", "learner.sft.steps=30", "task.heldout_size=256", "run.progress=false",
              f"run.dir={run}", "run.steps=800", "run.stop_at_exact_match=0.5", "actors.processes=2",
              f"run.eval_on={eval_on}", wait=True)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["target_reached_at"] is not None, summary
    # Started while the learner built: each process prepared its model and engine before joining.
    for i in range(2):
        log = open(os.path.join(run, "actors", f"proc-{i}.log")).read()
        assert "model and engine were prepared before joining" in log, log
    evals = [m for m in read_metrics(run) if "eval/exact_match" in m]
    # eval/generate_seconds: the actor processes' engine time, reported only by their evaluation
    assert all(("eval/generate_seconds" in m) == (eval_on == "actors") for m in evals), evals[-1]
