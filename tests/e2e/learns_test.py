"""End to end: a short seeded run of the default pipeline raises the training reward."""
import json
import os
import subprocess
import sys

import numpy as np

from cadence.launch.metrics import read_metrics
from cadence.launch.run.train import train


def test_short_run_raises_training_reward(small_config, tmp_path):
    cfg = small_config("run.steps=80", "run.eval_every=40", "learner.sft.steps=30")
    summary = train(cfg, str(tmp_path / "run"))
    rows = [m for m in read_metrics(str(tmp_path / "run")) if m["step"] > 0]
    first = np.mean([m["reward/mean"] for m in rows[:10]])
    last = np.mean([m["reward/mean"] for m in rows[-10:]])
    assert last > first + 0.1, (first, last)
    assert summary["samples"] == 80 * cfg.learner.batch_size
    for m in rows:
        assert {"step", "samples", "wall_time", "reward/mean", "staleness/mean"} <= m.keys()
    assert [m["step"] for m in rows] == list(range(1, 81))
    assert any("eval/exact_match" in m for m in rows)


def test_cli_train_then_eval(tmp_path):
    run = tmp_path / "cli-run"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={run}", "run.steps=4",
                          "run.eval_every=2", "learner.sft.steps=2", "task.heldout_size=32"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "heldout EM" in out.stderr  # the progress display
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = read_metrics(str(run))
    assert rows[0]["step"] == 0 and "eval/exact_match" in rows[0]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["wall_time"] >= 0 for r in rows)
    assert rows[2]["eval/exact_match"] is not None
    ev = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "eval", str(run)],
                        capture_output=True, text=True, timeout=300, env=env)
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout)
    assert result["heldout_size"] == 32
    assert result["eval/exact_match"] == summary["final_eval"]["eval/exact_match"]
    # a second run into the same directory refuses instead of mixing two runs' metrics
    again = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={run}", "run.steps=1"],
                           capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 2 and "already holds a run" in again.stderr
    bad = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "eval", str(tmp_path / "nothing")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 1 and "not a Cadence run directory" in bad.stderr


def test_evaluation_every_n_samples_follows_samples_not_steps(small_config, tmp_path):
    # B=16: samples 16, 32, 48, 64, 80, 96 -> crossings of 40 at steps 3 and 5, plus the final step
    cfg = small_config("run.steps=6", "run.eval_every=1", "run.eval_every_samples=40", "learner.batch_size=16",
                       "learner.microbatch_size=8", "learner.sft.steps=0", "task.heldout_size=8")
    train(cfg, str(tmp_path / "run"))
    rows = read_metrics(str(tmp_path / "run"))
    assert [m["step"] for m in rows if "eval/exact_match" in m] == [0, 3, 5, 6]
