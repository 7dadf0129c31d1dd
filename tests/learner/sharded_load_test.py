"""An HF checkpoint loads straight into a 4-device CPU mesh: no device ever holds more than its
shard plus one tensor, and the values equal the one-device load.

JAX fixes the CPU device count when it initializes (this suite runs on one device), so the load
runs in a child process (tests/learner/sharded_load_checks.py).
"""
import json
import os
import subprocess
import sys

from cadence.learner.models.config import ModelConfig
from cadence.learner.models.hf_random import write_random_checkpoint

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(os.path.dirname(__file__), "sharded_load_checks.py")
# Eight layers, so no single tensor comes near a device's shard of the whole; biases (1-D over
# heads), an untied head, several files (tensors split across them).
MODEL = ModelConfig(vocab_size=64, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=128,
                    max_seq_len=32, qkv_bias=True, tie_embeddings=False)


def test_sharded_load_holds_a_shard_plus_one_tensor_per_device_and_equals_one_device(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    files = write_random_checkpoint(ckpt, MODEL, tokenizer=False, max_shard_bytes=200_000)
    assert len(files) > 1
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, SCRIPT, ckpt], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 6, proc.stdout
    for r in rows:
        assert r["same_values"] and r["placed_as_laid_out"], r
        assert r["peak_device_bytes"] <= r["shard_bytes"] + r["largest_tensor_bytes"], r
        # the measure can tell: the whole-then-place load holds the whole model on one device
        assert r["whole_then_place_peak_bytes"] >= r["whole_bytes"] > r["shard_bytes"] + r["largest_tensor_bytes"], r
