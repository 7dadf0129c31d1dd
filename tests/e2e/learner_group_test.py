"""`cadence train learner.processes=2`: two real learner processes (jax.distributed on loopback,
gloo CPU collectives, params and Adam split over them by the default fsdp mesh)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cadence.launch.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["learner.sft.steps=5", "task.heldout_size=32", "run.progress=false"]
COMPARED = ("loss", "pg_loss", "grad_norm", "clip_frac", "entropy", "reward/mean", "eval/exact_match")


def cadence(*args, timeout=1500):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_two_processes_equal_one_in_sync_mode_and_resume_on_one(tmp_path):
    # checkpoints every 2 steps: written asynchronously by both processes while training goes on;
    # the controller measures (its dwell keeps B): both processes run the units it asks for; packed
    # rows of 64 with shared prompts, split over the processes, and the microbatches without a
    # signal skipped by both (the leader sends which)
    sync = BASE + ["actors.max_staleness=0", "run.steps=5", "run.eval_every=5", "checkpoint.every_steps=2",
                   "controller.enabled=true", "controller.dwell=1000", "learner.microbatch_tokens=128",
                   "learner.row_tokens=64", "learner.share_prompts=true", "learner.skip_zero_advantage=true"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    r1 = cadence(*sync, f"run.dir={one}")
    r2 = cadence(*sync, "learner.processes=2", f"run.dir={two}")
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert r2.returncode == 0, r2.stderr[-3000:]
    summary = json.loads(r2.stdout.strip().splitlines()[-1])  # process 0's; the follower prints nothing
    assert summary["steps"] == 5 and summary["run_dir"] == two
    rows1, rows2 = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in rows2] == [r["step"] for r in rows1] == list(range(6))
    for a, b in zip(rows1, rows2):  # the same samples, the same updates (float sums in another order)
        for key in COMPARED:
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-5, err_msg=f"step {a['step']} {key}")
        assert b.get("samples") == a.get("samples")
        assert b.get("skipped_microbatches") == a.get("skipped_microbatches")
        if a["step"]:  # the noise scale's whole-group units, measured over both processes
            assert len(a["unit_grad_norm_sq"]) >= 2
            np.testing.assert_allclose(b["unit_grad_norm_sq"], a["unit_grad_norm_sq"], rtol=1e-4, atol=1e-8)

    # The checkpoint written by both processes (params and Adam split over them) resumes on one.
    r3 = cadence("--resume", f"run.dir={two}", "learner.processes=1", "run.steps=7")
    assert r3.returncode == 0, r3.stderr[-3000:]
    rows = read_metrics(two)
    assert [r["step"] for r in rows] == list(range(8))
    assert all(np.isfinite(r["loss"]) for r in rows[1:])


def test_two_processes_measure_the_unclipped_units_of_stale_batches_together(tmp_path):
    # asynchronous: every stale update's noise units come from a pass of their own on the
    # unclipped objective; the follower must run that pass too (the leader sends which), or the
    # two processes' collectives would not match and the run would hang or fail
    run = str(tmp_path / "run")
    r = cadence(*BASE, "actors.max_staleness=1", "run.steps=6", "run.eval_every=6", "controller.enabled=true",
                "controller.dwell=1000", "controller.noise_every=1", "learner.processes=2", f"run.dir={run}",
                timeout=600)  # ~1-2 min; a follower without the pass hangs (tried)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [row for row in read_metrics(run) if row["step"]]
    assert len(rows) == 6
    stale = [row for row in rows if row["staleness/max"] > 0]
    assert stale, [row["staleness/max"] for row in rows]
    for row in rows:
        assert row["noise/measured"] == 1
        # the units' own batch norm exactly where the batch was stale (coupled correction, the default)
        assert ("unit_batch_grad_norm_sq" in row) == (row["staleness/max"] > 0)
        assert len(row["unit_grad_norm_sq"]) >= 2 and np.isfinite(row["loss"])


def test_a_group_that_cannot_start_exits_nonzero_naming_the_key(tmp_path):
    # 3 tensor-parallel devices do not divide the group's 2: every process fails at start, none hangs
    r = cadence("learner.processes=2", "learner.mesh.tensor=3", "learner.mesh.fsdp=1",
                f"run.dir={tmp_path / 'run'}", timeout=600)
    assert r.returncode != 0
    assert "learner.mesh" in r.stderr


def test_sigterm_to_the_group_saves_a_final_checkpoint_and_exits_zero(tmp_path):
    import signal
    import time

    run = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "cadence.launch.cli", "train", "learner.processes=2", *BASE,
                             "run.steps=500", "checkpoint.every_steps=0", f"run.dir={run}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = os.path.join(run, "metrics.jsonl")
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and len(read_metrics(run)) >= 4:  # step 0 (eval) + 3 updates
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)  # to the launcher: process 0 saves with the follower, then all stop
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["preempted"] is True and summary["steps"] >= 3
    assert os.path.isdir(os.path.join(run, "checkpoints", str(summary["steps"])))
