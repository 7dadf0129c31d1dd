"""A learner of 2 processes (one CPU device each, fsdp 2) publishes to actor processes without a
whole-model copy: each learner process serves the pieces its devices hold, and the actors
assemble a version from both (protocols/weights_wire.fetch_all). Process 0 sends half the
model per transfer; an actor missing the other half would fail its weights check."""
import glob
import json
import os
import subprocess
import sys

import pytest

from cadence.launch.config import load_config, preflight
from cadence.launch.metrics import read_metrics
from cadence.learner import sharding
from cadence.learner.models.llama import abstract_params

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_each_learner_process_serves_its_own_pieces(tmp_path):
    run = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", "learner.processes=2",
                        "actors.processes=2", "run.steps=4", "learner.sft.steps=2", "task.heldout_size=16",
                        "run.eval_every=1000", "run.progress=false", f"run.dir={run}"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [m for m in read_metrics(run) if m["step"] > 0]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    last = rows[-1]
    sent, sent_bytes = last["actors/weights_sent"], last["actors/weights_sent_bytes"]
    assert sent >= 2, last
    # the model's bytes (float32): half of them leave process 0 per transfer, the rest process 1
    whole = sharding.tree_bytes(abstract_params(preflight(load_config()).model)[1])
    assert sent_bytes == sent * whole // 2, (sent_bytes, sent, whole)
    logs = "".join(open(p).read() for p in glob.glob(os.path.join(run, "actors", "*.log")))
    assert "failed" not in logs and "samples sent" in logs, logs[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 4 * 128


def test_a_learner_process_holding_no_distinct_piece_still_answers_actors(tmp_path):
    # The tiny model's arrays do not split over 3 devices, so each is replicated: process 0 holds
    # every piece and processes 1 and 2 none. They must answer with an empty transfer (they once
    # failed building bucket 0 of 0, and the actors waited on them until their timeout).
    run = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", "learner.processes=3",
                        "actors.processes=1", "run.steps=3", "learner.sft.steps=2", "task.heldout_size=16",
                        "learner.batch_size=48", "learner.microbatch_size=24", "run.eval_every=1000",
                        "run.progress=false", f"run.dir={run}"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "weight server" not in r.stderr, r.stderr[-3000:]
    last = [m for m in read_metrics(run) if m["step"] > 0][-1]
    assert last["step"] == 3
    whole = sharding.tree_bytes(abstract_params(preflight(load_config()).model)[1])
    assert last["actors/weights_sent_bytes"] == last["actors/weights_sent"] * whole, last
    logs = "".join(open(p).read() for p in glob.glob(os.path.join(run, "actors", "*.log")))
    assert "failed" not in logs and "samples sent" in logs, logs[-2000:]
