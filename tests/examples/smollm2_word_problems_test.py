"""examples/smollm2-word-problems: its config validates against a checkpoint (a small random one here,
in the checkpoint's place), and its held-out script generates, scores and breaks down by op count."""
import json
import os
import subprocess
import sys

import pytest

from cadence.launch.config import load_config
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.hf_random import write_random_checkpoint

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
HERE = os.path.join(ROOT, "examples", "smollm2-word-problems")
CKPT = ModelConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=1024)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    write_random_checkpoint(str(d), CKPT, seed=3)  # the tiny byte-level BPE with a ChatML template
    return d


def test_the_config_is_a_small_pretrained_grpo_run(ckpt, tmp_path, monkeypatch):
    # model.path is "~/.cache/cadence/smollm2-135m-instruct": put the small checkpoint there
    cache = tmp_path / ".cache" / "cadence"
    cache.mkdir(parents=True)
    (cache / "smollm2-135m-instruct").symlink_to(ckpt)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config([os.path.join(HERE, "config.yaml")])
    assert cfg.model.path == str(cache / "smollm2-135m-instruct")  # "~" is the user's home
    assert (cfg.task.name, cfg.task.format, cfg.task.max_ops) == ("word_problems", "chat", 3)
    assert cfg.learner.batch_size // cfg.learner.group_size == 8 and cfg.learner.group_size == 4
    assert 1e-6 <= cfg.learner.optimizer.lr <= 5e-6 and cfg.learner.sft.steps == 0
    assert cfg.engine.max_new_tokens == 256
    assert ModelConfig(path="/abs/dir").path == "/abs/dir"


@pytest.mark.slow  # a subprocess that compiles the engine: ~15-40 s
def test_heldout_script_reports_accuracy_by_op_count(ckpt):
    env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "heldout.py"), "--config", os.path.join(HERE, "config.yaml"),
                          "--limit", "6", "--show", "2", f"model.path={ckpt}", "engine.max_new_tokens=96"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["n"] == 6 and sum(result["n_by_ops"].values()) == 6
    assert 0.0 <= result["accuracy"] <= 1.0 and result["max_new_tokens"] == 96
    assert len(result["samples"]) == 2 and all("\\boxed" not in s["problem"] for s in result["samples"])
