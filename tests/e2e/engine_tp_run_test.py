"""`cadence train` with an actor process whose built-in engine decodes tensor-parallel over 4 CPU
devices (engine.tensor_parallel=4): the process receives the learner's weight publications into
its shards, samples with them, and the run trains."""
import json
import os
import subprocess
import sys

import pytest

from cadence.launch.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_an_actor_process_with_a_tensor_parallel_engine_samples_the_published_weights(tmp_path):
    run = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={run}", "run.steps=3",
                           "actors.processes=1", "engine.tensor_parallel=4", "learner.sft.steps=0",
                           "task.heldout_size=8", "run.eval_every=0", "run.progress=false"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["ledger"]["consumed"] > 0, summary
    with open(os.path.join(run, "actors", "proc-0.log")) as f:
        log = f.read()
    assert "tensor-parallel over 4 cpu devices" in log, log
    versions = [m["step"] for m in read_metrics(run) if m.get("actor/proc-0/samples_per_second", 0) > 0]
    assert versions, "the actor process sent no samples"


def test_more_tensor_parallel_devices_than_the_process_has_is_a_config_error(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={tmp_path / 'run'}",
                           "run.steps=1", "engine.tensor_parallel=3", "learner.sft.steps=0", "run.progress=false"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "engine.tensor_parallel: 3 devices asked, but this process has 2" in proc.stderr
