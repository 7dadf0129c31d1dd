"""Checkpoint-and-resume through the real CLI in subprocesses: SIGTERM, kill -9, exact continuation."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from cadence.launch.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["learner.sft.steps=5", "task.heldout_size=32", "run.eval_every=4", "run.progress=false"]
# Measurements of time, and of the generation side (per-actor gauges, queue depth), which depend on
# how threads interleave: when a gauge is read, the actor may or may not hold its next grant.
TIMING = ("seconds", "per_second", "wall_time", "checkpoint/", "actors/", "actor/", "queue/")


def cadence(*args, wait=True):
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "cadence.launch.cli", "train", *args]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def wait_for_step(run_dir, step, proc, timeout=300):
    path = os.path.join(run_dir, "metrics.jsonl")
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(path):
            rows = [json.loads(line) for line in open(path) if line.endswith("\n")]
            if rows and rows[-1]["step"] >= step:
                return rows[-1]["step"]
        time.sleep(0.02)
    raise TimeoutError(step)


def load_arrays(run_dir):
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as c:
        return c.restore(os.path.join(run_dir, "params"))


def deterministic(rows):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def leaves(tree):
    import jax
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# actor threads (the default); and an actor process that also runs the held-out evaluation, which
# must take nothing from the training prompt stream or the sampling keys
@pytest.mark.parametrize("actors", [(), ("actors.processes=1", "run.eval_on=actors")], ids=["threads", "eval_on_actors"])
def test_sigterm_then_resume_is_bitwise_identical_in_sync_mode(tmp_path, actors):
    sync = ["actors.max_staleness=0", "run.steps=16", "checkpoint.every_steps=0", *actors]
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    out = cadence(*BASE, *sync, f"run.dir={straight}")
    assert out.returncode == 0, out.stderr

    proc = cadence(*BASE, *sync, f"run.dir={broken}", wait=False)
    wait_for_step(broken, 8, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err  # a clean exit after the final checkpoint
    stopped_at = read_metrics(broken)[-1]["step"]
    assert 8 <= stopped_at < 16, "the signal should land mid-run"
    out = cadence("--resume", f"run.dir={broken}")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["resumed_from"][-1]["step"] == stopped_at
    if actors:  # the evaluations were the actor process's (its engine time is in them)
        assert all("eval/generate_seconds" in r for r in read_metrics(broken) if "eval/reward" in r)

    a, b = load_arrays(straight), load_arrays(broken)
    for x, y in zip(leaves(a), leaves(b), strict=True):
        assert np.array_equal(x, y)
    ra, rb = read_metrics(straight), read_metrics(broken)
    assert [r["step"] for r in rb] == list(range(17))
    assert deterministic(ra) == deterministic(rb)
    # the optimizer state too: the final checkpoints of both runs hold the same Adam moments
    sa, sb = json.load(open(os.path.join(straight, "summary.json"))), json.load(open(os.path.join(broken, "summary.json")))
    assert sa["ledger"] == sb["ledger"]


def _opt_state(run_dir):
    import orbax.checkpoint as ocp
    step = max(int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.isdigit())
    with ocp.StandardCheckpointer() as c:
        return c.restore(os.path.join(run_dir, "checkpoints", str(step), "state"))


def test_adam_state_identical_after_sigterm_resume(tmp_path):
    sync = ["actors.max_staleness=0", "run.steps=10", "checkpoint.every_steps=0"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert cadence(*BASE, *sync, f"run.dir={a}").returncode == 0
    proc = cadence(*BASE, *sync, f"run.dir={b}", wait=False)
    wait_for_step(b, 4, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert cadence("--resume", f"run.dir={b}").returncode == 0
    for x, y in zip(leaves(_opt_state(a)), leaves(_opt_state(b)), strict=True):
        assert np.array_equal(x, y)


def _ledger(run_dir):
    return json.load(open(os.path.join(run_dir, "summary.json")))["ledger"]


@pytest.mark.parametrize("when", ["between_saves", "during_save"])
def test_kill_9_then_resume_loses_nothing_and_repeats_nothing(tmp_path, when):
    run = str(tmp_path / "run")
    # async mode (max_staleness=2): there are queued and in-flight groups at every checkpoint
    args = [*BASE, "actors.max_staleness=2", "run.steps=30", f"run.dir={run}",
            "checkpoint.every_steps=5"]
    proc = cadence(*args, wait=False)
    if when == "during_save":
        # a save starts right after step 10 is logged; kill while orbax is still writing
        wait_for_step(run, 10, proc)
    else:
        wait_for_step(run, 13, proc)
    proc.kill()
    proc.communicate()
    ckpts = sorted(int(n) for n in os.listdir(os.path.join(run, "checkpoints")) if n.isdigit())
    assert ckpts and ckpts[-1] <= 13
    out = cadence("--resume", f"run.dir={run}")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    resumed = summary["resumed_from"][-1]
    assert resumed["step"] in ckpts
    led = summary["ledger"]  # verify() passed inside the run: each index in exactly one state
    assert led["consumed"] == 30 * 16  # every update trained on exactly B/G distinct groups
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(31))
    assert all(r["staleness/max"] <= 2 for r in rows[1:])
    # buffered trajectories came back from the checkpoint (and were consumed, per the ledger)
    assert resumed["queued_restored"] > 0


def test_finished_run_and_incompatible_resume(tmp_path):
    run = str(tmp_path / "run")
    assert cadence(*BASE, "run.steps=2", f"run.dir={run}").returncode == 0
    again = cadence("--resume", f"run.dir={run}")
    assert again.returncode == 3 and "already finished at step 2" in again.stderr
    changed = cadence("--resume", f"run.dir={run}", "run.steps=4", "task.num_digits=5", "model.n_layers=3")
    assert changed.returncode == 2
    assert "model.n_layers" in changed.stderr and "task.num_digits" in changed.stderr
    more = cadence("--resume", f"run.dir={run}", "run.steps=4")
    assert more.returncode == 0, more.stderr
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3, 4]
    nothing = cadence("--resume", f"run.dir={tmp_path / 'empty'}")
    assert nothing.returncode == 2 and "nothing to resume" in nothing.stderr
