"""The built-in engine decodes tensor-parallel (engine.tensor_parallel) on 4 CPU devices: the same
tokens and log-probs as on one device, each device holding only its shard of the params and of
the KV cache, and weights published by the learner arriving straight into those shards.

JAX fixes the CPU device count when it initializes (this suite runs on one device), so the checks
run in a child process (tests/actors/engine_tp_checks.py).
"""
import json
import os
import subprocess
import sys

import pytest

from cadence.actors.engine import EngineConfig, JaxEngine
from cadence.learner.models import llama
from cadence.learner.models.config import ModelConfig

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(os.path.dirname(__file__), "engine_tp_checks.py")


@pytest.fixture(scope="module")
def checks():
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = {r["check"]: r for r in map(json.loads, (line for line in proc.stdout.splitlines() if line.startswith("{")))}
    assert set(rows) == {"engine", "published"}, proc.stdout
    return rows


def test_tensor_parallel_decoding_gives_the_one_device_tokens_and_logprobs(checks):
    r = checks["engine"]
    assert r["tp"] == 4 and r["devices"] == 4, r
    for mode in ("greedy", "sampled"):
        assert r[mode]["same_tokens"], r
        assert r[mode]["max_logprob_diff"] <= 1e-5, r
    assert r["compilations"] == 1, r


def test_each_device_holds_only_its_shard_of_the_params_and_the_cache(checks):
    r = checks["engine"]
    assert r["max_device_bytes"] <= r["total_bytes"] / r["tp"] + r["replicated_bytes"], r
    assert r["replicated_bytes"] <= r["total_bytes"] / 100, r  # every parameter of this model splits
    assert r["cache_split"] and not r["cache_whole"], r  # the decode loop carries [B, KV / tp, L, Dh]


def test_a_published_version_lands_in_the_engine_shards_and_samples(checks):
    r = checks["published"]
    assert r["version"] == 5 and r["in_engine_shards"], r
    assert r["devices"] == 4 and r["max_device_bytes"] <= r["total_bytes"] / 4, r
    assert r["greedy"]["same_tokens"] and r["greedy"]["max_logprob_diff"] <= 1e-5, r


def test_more_devices_than_the_process_has_is_an_error_naming_the_key():
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
    graphdef, _ = llama.abstract_params(cfg)
    with pytest.raises(ValueError, match="engine.tensor_parallel: 64 devices asked"):
        JaxEngine(cfg, graphdef, EngineConfig(tensor_parallel=64), eos_id=0, pad_id=0)
    with pytest.raises(ValueError, match="tensor_parallel: must be >= 1"):
        EngineConfig(tensor_parallel=0).validate()
