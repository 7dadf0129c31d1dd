"""`model.path=DIR` wiring: the launch config and build_policy use the checkpoint's model and tokenizer."""

import jax
import numpy as np
import pytest

from launch.config import load_config
from launch.config_loader import ConfigError
from launch.policy import build_policy, export_policy
from learner.models import hf_load
from learner.models.config import ModelConfig
from learner.models.hf_random import write_random_checkpoint
from learner.models.hf_tokenizer import HFTokenizer

CKPT = ModelConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=256,
                   qkv_bias=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    write_random_checkpoint(str(d), CKPT, seed=5)
    return d


def test_build_policy_loads_checkpoint_model_and_tokenizer(ckpt, tmp_path):
    cfg = load_config(overrides=[f"model.path={ckpt}", "model.param_dtype=bfloat16"])
    policy = build_policy(cfg)
    assert isinstance(policy.tokenizer, HFTokenizer)
    assert policy.model_cfg.qkv_bias and policy.model_cfg.vocab_size == 320 and policy.model_cfg.d_model == 32
    assert policy.model_cfg.param_dtype == "bfloat16" and policy.model_cfg.path == str(ckpt)
    _, _, ref = hf_load.load_checkpoint(str(ckpt), ModelConfig(param_dtype="bfloat16"))
    for a, b in zip(jax.tree.leaves(policy.params), jax.tree.leaves(ref)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    export_policy(policy, policy.params, str(tmp_path / "out"))
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_default_policy_is_still_the_tiny_char_model():
    policy = build_policy(load_config())
    assert policy.model_cfg == ModelConfig() and type(policy.tokenizer).__name__ == "CharTokenizer"


def test_jsonl_task_validates_against_the_checkpoint(ckpt):
    sample = "actors/tasks/data/math_sample.jsonl"
    base = [f"model.path={ckpt}", "task.name=jsonl", f"task.path={sample}", "task.heldout_size=2"]
    with pytest.raises(ConfigError, match="engine.max_new_tokens.*longest answer"):
        load_config(overrides=base)
    cfg = load_config(overrides=[*base, "engine.max_new_tokens=80"])
    assert cfg.task.name == "jsonl"
    with pytest.raises(ConfigError, match="max_position_embeddings \\(256\\)"):
        load_config(overrides=[*base, "engine.max_new_tokens=200"])


def test_config_errors_name_the_problem(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="task.name: the jsonl task needs a checkpoint tokenizer"):
        load_config(overrides=["task.name=jsonl", "task.path=x.jsonl"])
    with pytest.raises(ConfigError, match="model.path: .*config.json"):
        load_config(overrides=[f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match="task.path: "):
        load_config(overrides=[f"model.path={ckpt}", "task.name=jsonl", f"task.path={tmp_path}/none.jsonl",
                               "task.heldout_size=2"])
