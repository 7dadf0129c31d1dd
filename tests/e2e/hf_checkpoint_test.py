"""End to end from a Hugging Face directory: `cadence train model.path=DIR task.name=jsonl` loads
the checkpoint and its tokenizer, warms up (SFT on the reference answers) and trains on the JSONL math task in chat format, and exports the
trained weights back as a Hugging Face directory that loads to exactly the trained params."""
import jax
import numpy as np

from cadence.launch import artifacts
from cadence.learner.models import hf_load
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.hf_random import write_random_checkpoint
from cadence.launch.metrics import read_metrics
from cadence.launch.run.train import train

CKPT = ModelConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=512,
                   qkv_bias=True)


def test_train_from_hf_checkpoint_on_jsonl_math_exports_trained_weights(small_config, tmp_path):
    ckpt = tmp_path / "ckpt"
    write_random_checkpoint(str(ckpt), CKPT, seed=5)
    cfg = small_config(f"model.path={ckpt}", "task.name=jsonl", "task.path=actors/tasks/data/math_sample.jsonl",
                       "task.prompt_field=question", "task.answer_field=answer", "task.format=chat",
                       "task.heldout_size=4", "engine.max_new_tokens=96", "run.steps=2", "run.eval_every=0",
                       "learner.sft.steps=2", "learner.sft.batch_size=8", "learner.batch_size=16", "learner.microbatch_size=16")
    run = tmp_path / "run"
    summary = train(cfg, str(run))
    assert summary["steps"] == 2 and summary["samples"] == 32
    assert [m["step"] for m in read_metrics(str(run))] == [0, 1, 2]

    _, _, start = hf_load.load_checkpoint(str(ckpt))
    model_cfg, _, exported = hf_load.load_checkpoint(summary["hf_export"])
    assert model_cfg.qkv_bias and model_cfg.vocab_size == 320
    assert (run / "hf" / "tokenizer.json").is_file() and (run / "hf" / "tokenizer_config.json").is_file()
    trained = artifacts.load_params(str(run), exported)
    for e, t, s in zip(jax.tree.leaves(exported), jax.tree.leaves(trained), jax.tree.leaves(start)):
        assert np.asarray(e).tobytes() == np.asarray(t).tobytes()  # the export is the trained params
    assert any(not np.array_equal(np.asarray(t), np.asarray(s))
               for t, s in zip(jax.tree.leaves(trained), jax.tree.leaves(start)))  # SFT warm-up moved them
