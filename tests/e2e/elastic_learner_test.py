"""An elastic learner at any device count, with real local learner processes (jax.distributed on
loopback, one CPU device each): 3 devices do not split the default microbatch of 32 rows, so the
rows are re-planned and the batch refit (128 -> 120, Adam by the square-root rule) instead of the
start being refused; a checkpoint written on 4 processes resumes on 3 and back on 4 with the same
params, the batch and learning rate returning exactly to the configured ones."""
import json
import math
import os
import subprocess
import sys

import pytest

from cadence.launch.metrics import read_metrics
from tests.launch.ray_launch_test import checkpoint_digest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["learner.sft.steps=2", "task.heldout_size=16", "run.eval_every=1000", "run.progress=false",
        "checkpoint.every_steps=1", "checkpoint.keep=100", "run.resume_digest=true"]
LR = 1e-3  # learner.optimizer.lr, tuned at the configured batch of 128


def cadence(*args, timeout=900):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_four_then_three_then_four_processes(tmp_path):
    run = str(tmp_path / "run")
    for processes, steps, resume in ((4, 2, ()), (3, 4, ("--resume",)), (4, 6, ("--resume",))):
        r = cadence(*resume, *BASE, f"learner.processes={processes}", f"run.steps={steps}", f"run.dir={run}")
        assert r.returncode == 0, r.stderr[-3000:]
    rows = {r["step"]: r for r in read_metrics(run)}
    assert sorted(rows) == list(range(7))
    # on 3 devices: B 128 -> 120 with lr * sqrt(120 / 128); back on 4: exactly the configured values
    assert [rows[s]["batch_size"] for s in range(1, 7)] == [128, 128, 120, 120, 128, 128]
    for s, lr in ((1, LR), (3, LR * math.sqrt(120 / 128)), (5, LR)):
        assert rows[s]["learning_rate"] == pytest.approx(lr, rel=1e-6), s
    assert "microbatch_size 32 -> 30" in rows[3]["controller/decision"]
    assert "refit B 128 -> 120" in rows[3]["controller/decision"]
    assert "refit B 120 -> 128" in rows[5]["controller/decision"]
    assert rows[2].get("controller/decision") is None and rows[4].get("controller/decision") is None
    summary = json.loads(open(os.path.join(run, "summary.json")).read())
    assert summary["samples"] == 8 * summary["ledger"]["consumed"] == 2 * 128 + 2 * 120 + 2 * 128
    # each resume started from bit for bit the params the other process count wrote
    resumed = summary["resumed_from"]
    assert [(r["step"], r["learner_processes"]) for r in resumed] == [(2, 3), (4, 4)]
    for r in resumed:
        assert r["params_sha256"] == checkpoint_digest(run, r["step"])


def test_three_processes_learn_sort6(tmp_path):
    # the acceptance run: `cadence train learner.processes=3` (re-planned rows) to 0.5; it
    # replaced the same run at 2 processes (an even split learns through the same group and rows)
    run = str(tmp_path / "run")
    r = cadence("learner.processes=3", "run.stop_at_exact_match=0.5", "run.steps=800", "task.heldout_size=128",
                "run.progress=false", f"run.dir={run}", timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(open(os.path.join(run, "summary.json")).read())
    assert summary["target_reached_at"] is not None, summary
    assert summary["final_eval"]["eval/exact_match"] >= 0.5
