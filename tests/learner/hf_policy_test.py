"""`model.path=DIR` wiring: the launch config and build_policy use the checkpoint's model and tokenizer."""

import jax
import numpy as np
import pytest

from cadence.launch.config import load_config, preflight
from cadence.launch.config_loader import ConfigError
from cadence.learner.models.policy import build_policy, export_policy
from cadence.learner.models import hf_load
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.hf_random import write_random_checkpoint
from cadence.learner.models.hf_tokenizer import HFTokenizer

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


def test_build_policy_takes_the_tokenizer_preflight_loaded_for_the_task(ckpt, monkeypatch):
    # a run loads the checkpoint's tokenizer once (preflight, for its task) and the policy encodes with it
    cfg = load_config(overrides=[f"model.path={ckpt}", "task.name=jsonl",
                                 "task.path=actors/tasks/data/math_sample.jsonl",
                                 "task.heldout_size=2", "engine.max_new_tokens=80"])
    task = preflight(cfg).task
    loads = []
    monkeypatch.setattr(HFTokenizer, "__init__", lambda self, *a: loads.append(a))
    policy = build_policy(cfg, tokenizer=task.tokenizer)
    assert policy.tokenizer is task.tokenizer and loads == []


def test_default_policy_is_still_the_tiny_char_model():
    policy = build_policy(load_config())
    assert policy.model_cfg == ModelConfig() and type(policy.tokenizer).__name__ == "CharTokenizer"


def test_jsonl_task_validates_against_the_checkpoint(ckpt):
    sample = "actors/tasks/data/math_sample.jsonl"
    base = [f"model.path={ckpt}", "task.name=jsonl", f"task.path={sample}", "task.heldout_size=2"]
    with pytest.raises(ConfigError, match="engine.max_new_tokens.*longest answer"):
        preflight(load_config(overrides=base))
    cfg = load_config(overrides=[*base, "engine.max_new_tokens=80"])
    assert cfg.task.name == "jsonl" and preflight(cfg).task.name == "jsonl"
    with pytest.raises(ConfigError, match="max_position_embeddings \\(256\\)"):
        preflight(load_config(overrides=[*base, "engine.max_new_tokens=200"]))


def test_config_errors_name_the_problem(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="task.name: the jsonl task needs a checkpoint tokenizer"):
        load_config(overrides=["task.name=jsonl", "task.path=x.jsonl"])
    with pytest.raises(ConfigError, match="model.path: .*config.json"):
        preflight(load_config(overrides=[f"model.path={tmp_path}"]))
    with pytest.raises(ConfigError, match="task.path: "):
        preflight(load_config(overrides=[f"model.path={ckpt}", "task.name=jsonl",
                                         f"task.path={tmp_path}/none.jsonl", "task.heldout_size=2"]))


def test_pretrained_checkpoint_gets_pretrained_defaults_with_a_note(ckpt, tmp_path, capsys):
    # The tiny model's defaults (30 warm-up steps at 3e-3, RL at 1e-3) would wreck a pretrained model.
    notes = []
    cfg = load_config(overrides=[f"model.path={ckpt}"], notes=notes)
    assert cfg.learner.sft.steps == 0 and cfg.learner.optimizer.lr == 1e-6
    assert cfg.learner.ppo.critic_lr == 1e-5
    assert len(notes) == 1 and "learner.optimizer.lr=1e-06" in notes[0] and "learner.sft.steps=0" in notes[0]
    # What the user set stays as set (an explicit warm-up gets a pretrained-sized warm-up lr).
    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  optimizer:\n    lr: 3.0e-6\n")
    notes = []
    cfg = load_config([str(f)], [f"model.path={ckpt}", "learner.sft.steps=4"], notes=notes)
    assert cfg.learner.optimizer.lr == 3e-6 and cfg.learner.sft.steps == 4 and cfg.learner.sft.lr == 1e-5
    assert "learner.optimizer.lr" not in notes[0] and "learner.sft.steps" not in notes[0].split(":")[1].split("(")[0]
    # Without model.path nothing changes, and the CLI says what it chose.
    assert load_config().learner.optimizer.lr == 1e-3 and load_config().learner.sft.steps == 30
    from cadence.launch.cli import main
    assert main(["train", "--print-config", f"model.path={ckpt}"]) == 0
    out, err = capsys.readouterr()
    assert "cadence: note: model.path is a pretrained checkpoint" in err and "lr: 1.0e-06" in out
