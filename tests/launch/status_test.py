"""`cadence status` on hand-made run directories: the state from heartbeat, process and summary;
numbers from the tail of metrics.jsonl. (Real running / preempted / killed runs: tests/e2e/observability_test.py.)"""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from cadence.launch import cli

from cadence.launch.observe import status
from cadence.launch.config import RunConfig
from cadence.launch.observe.sinks import open_sinks


def make_run(path, steps=100, target=0.0, records=(), hb=None, summary=None, ckpt_steps=()):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.yaml"), "w") as f:
        yaml.safe_dump({"run": {"steps": steps, "stop_at_exact_match": target}, "actors": {"num_actors": 2}}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    if hb is not None:
        with open(os.path.join(path, "heartbeat.json"), "w") as f:
            json.dump(hb, f)
    if summary is not None:
        with open(os.path.join(path, "summary.json"), "w") as f:
            json.dump(summary, f)
    for s in ckpt_steps:
        os.makedirs(os.path.join(path, "checkpoints", str(s)))
    return str(path)


def beat(state="running", pid=None, host=None, age=0.0, interval=5.0):
    return {"pid": pid or os.getpid(), "host": host or socket.gethostname(), "state": state,
            "started_at": time.time() - 100, "time": time.time() - age, "interval": interval}


def records(n, t0=10.0, dt=0.5, b=64):
    out = [{"step": 0, "samples": 0, "wall_time": t0, "eval/exact_match": 0.1}]
    for s in range(1, n + 1):
        r = {"step": s, "samples": s * b, "wall_time": t0 + s * dt, "reward/mean": 0.01 * s, "batch_size": b,
             "staleness/mean": 1.0, "staleness/max": 1, "actors/tokens_per_second": 1000.0 + s,
             "learner/tokens_per_second": 2000.0, "queue/depth": 3, "dropped/stale": 1}
        if s % 10 == 0:
            r["eval/exact_match"] = 0.1 + 0.01 * s
        out.append(r)
    return out


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("hb, summary, state", [
    # heartbeats are made when the test runs (a parameter is built at collection, minutes earlier)
    (dict(), None, "running"),
    (dict(pid="dead"), None, "dead"),  # kill -9: the process is gone, no final word
    (dict(age=60.0), None, "dead"),  # alive, but no heartbeat for 60 s (interval 5): hung
    (dict(host="another-host", pid=1, age=2.0), None, "running"),  # another host: freshness decides
    (dict(host="another-host", pid=1, age=600.0), None, "dead"),
    (dict(state="finished"), {"preempted": False}, "finished"),
    (dict(state="preempted"), {"preempted": True}, "preempted"),
    (dict(state="failed"), None, "dead"),
    (None, {"preempted": True}, "preempted"),  # a run from before heartbeats
    (None, {"preempted": False}, "finished"),
    (None, None, "dead"),
])
def test_state_and_exit_code(tmp_path, hb, summary, state, capsys):
    if hb is not None:
        hb = beat(**dict(hb, pid=dead_pid()) if hb.get("pid") == "dead" else hb)
    run = make_run(tmp_path / "run", records=records(5), hb=hb, summary=summary)
    assert status.run_status(run)["state"] == state
    assert cli.main(["status", run]) == status.EXIT_CODES[state]
    assert state in capsys.readouterr().out


def test_numbers_come_from_the_tail_of_the_metrics(tmp_path):
    run = make_run(tmp_path / "run", steps=200, target=0.9, records=records(60), hb=beat(), ckpt_steps=(50, 25))
    st = status.run_status(run)
    assert (st["step"], st["steps_total"], st["samples"], st["batch_size"]) == (60, 200, 3840, 64)
    rewards = [0.01 * s for s in range(1, 61)]
    assert st["reward"] == pytest.approx(np.mean(rewards[-20:]))
    assert st["reward_trend"] == pytest.approx(np.mean(rewards[-20:]) - np.mean(rewards[-40:-20]))
    assert (st["exact_match"], st["exact_match_step"]) == (pytest.approx(0.7), 60)
    assert st["exact_match_trend"] == pytest.approx(0.1)
    assert st["samples_per_second"] == pytest.approx(64 / 0.5)  # B every 0.5 s
    assert st["eta_steps_seconds"] == pytest.approx(140 * 0.5)  # 140 steps left at 2 steps/s
    # exact match rises 0.1 per 5 s: 0.7 -> 0.9 in 10 s
    assert st["eta_target_seconds"] == pytest.approx(10.0)
    assert st["checkpoint_step"] == 50 and st["checkpoint_age"] < 60
    assert st["dropped"] == {"stale": 1} and st["queue_depth"] == 3


def test_tail_reads_a_long_file_from_its_end(tmp_path):
    run = make_run(tmp_path / "run", records=records(20000), hb=beat())
    rows = status.tail_records(os.path.join(run, "metrics.jsonl"))
    assert 2 * status.WINDOW <= len(rows) < 20000 and rows[-1]["step"] == 20000
    assert status.run_status(run)["step"] == 20000


def test_not_a_run_directory_exits_1(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path)]) == status.EXIT_NOT_A_RUN
    assert "not a Cadence run directory" in capsys.readouterr().err


def test_json_output(tmp_path, capsys):
    run = make_run(tmp_path / "run", records=records(3), hb=beat("finished"), summary={"preempted": False})
    assert cli.main(["status", run, "--json"]) == 4
    assert json.loads(capsys.readouterr().out)["state"] == "finished"


def test_watch_returns_when_the_run_stops(tmp_path, capsys):
    run = make_run(tmp_path / "run", records=records(3), hb=beat("preempted"), summary={"preempted": True})
    assert cli.main(["status", run, "--watch", "--interval", "0.1"]) == status.EXIT_CODES["preempted"]
    assert "preempted" in capsys.readouterr().out


def test_a_live_run_whose_records_stop_is_stalled(tmp_path, capsys):
    """Real sinks and heartbeat: the heartbeat thread keeps beating, but no record lands for
    run.stall_factor times the slowest recent update, so the run reads stalled (exit 7)."""
    run = make_run(tmp_path / "run")
    with open(os.path.join(run, "config.yaml"), "w") as f:
        yaml.safe_dump({"run": {"steps": 100, "stall_factor": 1.5}}, f)
    sinks = open_sinks(RunConfig(heartbeat_seconds=0.1), run, {})
    try:
        for s in range(4):  # updates that took 1 s each by the run's clock
            sinks.write({"step": s, "samples": 8 * s, "wall_time": 10.0 + s, "reward/mean": 0.5})
        sinks.heartbeat._write()
        st = status.run_status(run)
        assert st["state"] == "running", st["why"]
        # training is stuck from here on; the heartbeat thread goes on writing
        deadline = time.time() + 20
        while st["state"] == "running" and time.time() < deadline:
            time.sleep(0.2)
            st = status.run_status(run)
        assert st["state"] == "stalled" and "run.stall_factor=1.5" in st["why"], st
        assert status.heartbeat.read(run)["time"] > time.time() - 5  # the heartbeat itself is fresh
        assert cli.main(["status", run]) == status.EXIT_CODES["stalled"] == 7
        assert "stalled" in capsys.readouterr().out
        sinks.write({"step": 4, "samples": 32, "wall_time": 14.0, "reward/mean": 0.5})  # it recovers
        sinks.heartbeat._write()
        assert status.run_status(run)["state"] == "running"
    finally:
        sinks.close()
        sinks.finish({})


def test_a_starting_run_is_not_stalled(tmp_path):
    """Before this process has written two records (compiling, the warm-up) nothing is judged, and a
    run without a stall_factor in its config uses the default."""
    hb = dict(beat(), last_record_at=time.time() - 3600, records=1)
    run = make_run(tmp_path / "run", records=records(30), hb=hb)
    assert status.run_status(run)["state"] == "running"
    hb["records"] = 30  # now it has: 0.5 s updates, silent for an hour
    run = make_run(tmp_path / "run", records=records(30), hb=hb)
    assert status.run_status(run)["state"] == "stalled"
    # after its last update the run evaluates and exports (a large model's export takes minutes)
    run = make_run(tmp_path / "run", steps=30, records=records(30), hb=hb)
    assert status.run_status(run)["state"] == "running"


def test_status_shows_a_plugin_tasks_own_metrics(tmp_path, capsys):
    """A task without exact match: held-out reward, its eval/<name> and task/<name> metrics."""
    rows = [{"step": 0, "samples": 0, "wall_time": 1.0, "eval/reward": 0.2, "eval/tool_use": 0.4}]
    for s in range(1, 31):
        r = {"step": s, "samples": 8 * s, "wall_time": 1.0 + s, "reward/mean": 0.3, "task/tool_use": s / 30}
        if s % 15 == 0:
            r.update({"eval/reward": 0.2 + s / 100, "eval/tool_use": 0.5 + s / 100, "eval/reward_errors": 1})
        rows.append(r)
    run = make_run(tmp_path / "run", records=rows, hb=beat())
    st = status.run_status(run)
    assert st["exact_match"] is None
    assert (st["heldout_reward"], st["heldout_reward_step"]) == (pytest.approx(0.5), 30)
    assert st["heldout_reward_trend"] == pytest.approx(0.15)
    assert st["eval_metrics"] == {"tool_use": pytest.approx(0.8), "reward_errors": 1}
    assert st["task_metrics"]["tool_use"] == pytest.approx(np.mean([s / 30 for s in range(11, 31)]))
    assert cli.main(["status", run]) == 0
    out = capsys.readouterr().out
    assert "held-out reward" in out and "tool_use 0.800" in out and "task metrics" in out
