"""A sharded learner (4 CPU devices, fsdp 4) publishes to 2 actor processes without a whole-model
copy: weights go out in buckets of its shards (learner/weight_stream.py). At every publication
and every bucket built, no device holds an array larger than its largest parameter shard plus
one bucket (counted from jax.live_arrays(); the old gather put whole arrays on device 0, which
the same count sees); a separate process fetching a version gets the learner's values bit for
bit; and the run learns. Held-out evaluation (every 10 steps and at the end) is work for the actor
processes (run.eval_on=auto): the learner never gathers the model, and the same count runs while
the actors evaluate.

JAX fixes the CPU device count when it initializes, so the run is a child process
(tests/e2e/sharded_publish_checks.py).
"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(__file__), "sharded_publish_checks.py")
BUCKET = 32 << 10  # smaller than the largest parameter (64 KiB): a whole copy cannot hide under it


def test_fsdp4_publishes_buckets_of_shards_bitwise_and_learns(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "run"), str(BUCKET), "40"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["steps"] == 40 and r["samples"] > 40, r
    # the count can tell: a whole copy of the largest parameter is more than the bound
    assert r["fetched"]["largest_leaf_bytes"] > r["largest_shard_bytes"] + BUCKET, r
    for device, largest in enumerate(r["largest_per_device"]):
        assert largest <= r["largest_shard_bytes"] + BUCKET, (device, r)
    assert r["fetched"]["version"] == 3 and r["fetched"]["same"], r
    assert r["weights_sent"] >= 2 * 10, r  # both actor processes kept fetching
    assert r["reward_last"] > r["reward_first"] + 0.05, r
    # evaluation: by the actor processes at steps 0, 10, ..., 40, never a gather, counted meanwhile
    assert r["gathers"] == 0 and r["actor_evals"] == 5 and r["eval_samples"] > 0, r
    assert r["eval_steps"] == [0, 10, 20, 30, 40], r
    assert "eval/generate_seconds" in r["final_eval"] and "eval/exact_match" in r["final_eval"], r


def test_the_count_sees_the_gather_of_an_evaluation_on_the_learner(tmp_path):
    """run.eval_on=learner gathers the model onto process 0 to evaluate: the same count catches it
    (what the actor processes' evaluation removes)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "run"), str(BUCKET), "12", "learner"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["gathers"] >= 2 and r["actor_evals"] == 0, r  # step 0, step 10, the end
    assert r["largest_per_device"][0] > r["largest_shard_bytes"] + BUCKET, r


LORA = """
import json, os, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, {root!r})
from cadence.launch.metrics import read_metrics
from cadence.launch.run.train import train
from tests.e2e.lora_run_test import _cfg
run = sys.argv[2]
summary = train(_cfg(sys.argv[1], run, "run.steps=3", "actors.processes=1", "actors.num_actors=0",
                     "run.eval_every=0", "task.heldout_size=8", "actors.weights_bucket_mb=0.01"))
rows = read_metrics(run)
print(json.dumps({{"steps": summary["steps"], "sent": rows[-1]["actors/weights_sent"],
                  "sent_bytes": rows[-1]["actors/weights_sent_bytes"],
                  "logprob_diff_abs": [r["logprob_diff_abs"] for r in rows if "logprob_diff_abs" in r]}}))
"""


def test_fsdp4_lora_run_streams_adapters_only_and_actors_run_the_learners_policy(tmp_path):
    from tests.e2e.lora_run_test import fixture_dir as find_fixture

    fixture = find_fixture.__wrapped__()
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", LORA.format(root=ROOT), fixture, str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    adapters_bytes = 2 * 4 * 4 * (4 * (64 + 64) + 3 * (64 + 256))  # as lora_run_test counts them
    assert r["steps"] == 3 and r["sent"] >= 1
    # adapters only, in buckets of their shards (a transfer counts, bytes and all, when its last
    # bucket goes: read mid-transfer, the counters still agree)
    assert r["sent_bytes"] == r["sent"] * adapters_bytes, r
    assert r["logprob_diff_abs"] and all(d < 1e-4 for d in r["logprob_diff_abs"]), r  # sync mode
