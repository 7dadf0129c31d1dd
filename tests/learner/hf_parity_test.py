"""The Flax model loaded from HF checkpoints computes what transformers' PyTorch model computes."""

import dataclasses
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from cadence.actors.engine import EngineConfig, JaxEngine  # noqa: E402
from cadence.learner.models import hf_load, llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402

V = 96
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def _configs():
    return {
        # Llama 3 scaling with a short original context so the scaled band matters at T <= 40.
        "llama3": transformers.LlamaConfig(
            **COMMON, rope_theta=500000.0, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        "qwen2_tied": transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen2_untied": transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
        "qwen3": transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),  # head_dim != d/H
    }


def _save_random(hf_cfg, directory, dtype=torch.float32, seed=0):
    """A transformers model with every parameter perturbed (norms, biases too), saved to directory."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model = model.to(dtype)
    model.save_pretrained(directory)
    return model


def _flax_logits(path, tokens, base=ModelConfig()):
    cfg, graphdef, params = hf_load.load_checkpoint(str(path), base)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    forward = jax.jit(functools.partial(llama.forward, graphdef))  # eager would compile op by op
    return cfg, np.asarray(forward(params, jnp.asarray(tokens), positions, jnp.ones((b, t), bool)))


@pytest.mark.parametrize("name", ["llama3", "qwen2_tied", "qwen2_untied", "qwen3"])
def test_fp32_logits_match_transformers(tmp_path, name):
    hf_cfg = _configs()[name]
    model = _save_random(hf_cfg, tmp_path)
    tokens = np.random.default_rng(1).integers(0, V, (2, 40))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.float().numpy()
    cfg, ours = _flax_logits(tmp_path, tokens)
    assert cfg.tie_embeddings == hf_cfg.tie_word_embeddings
    assert cfg.qk_norm == (name == "qwen3") and cfg.qkv_bias == name.startswith("qwen2")
    assert cfg.rope_scaling_type == ("llama3" if name == "llama3" else "none")
    assert np.abs(ours - ref).max() <= 1e-4


def test_llama3_inv_freq_matches_transformers_and_is_scaled(tmp_path):
    # Guards the scaled-RoPE path directly: equal to HF's table and different from the unscaled one.
    model = _save_random(_configs()["llama3"], tmp_path)
    cfg = hf_load.hf_config.model_config_from_checkpoint(str(tmp_path))
    ref = model.model.rotary_emb.inv_freq.numpy()
    ours = np.asarray(llama.rope_inv_freq(cfg))
    plain = np.asarray(llama.rope_inv_freq(dataclasses.replace(cfg, rope_scaling_type="none")))
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    assert np.abs(plain - ref).max() > 1e-3


@pytest.mark.parametrize("name", ["llama3", "qwen2_untied", "qwen3"])
def test_bf16_logits_match_transformers(tmp_path, name):
    model = _save_random(_configs()[name], tmp_path, dtype=torch.bfloat16)
    tokens = np.random.default_rng(2).integers(0, V, (2, 24))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.float().numpy()
    cfg, ours = _flax_logits(tmp_path, tokens, ModelConfig(param_dtype="bfloat16", compute_dtype="bfloat16"))
    assert cfg.param_dtype == "bfloat16"
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel <= 2e-2


@pytest.mark.parametrize("name", ["llama3", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers_generate(tmp_path, name):
    model = _save_random(_configs()[name], tmp_path, seed=3)
    cfg, graphdef, params = hf_load.load_checkpoint(str(tmp_path))
    eos, pad, new = V - 1, 0, 12
    prompts = [[5, 17, 42, 8, 61, 3, 29], [70, 2, 33]]
    engine = JaxEngine(cfg, graphdef, EngineConfig(max_new_tokens=new, batch_buckets=(2,)), eos, pad)
    result = engine.generate(params, prompts, jax.random.key(0), greedy=True)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=pad)
        ref = out[0, len(prompt):].tolist()
        ours = result.tokens[row, : int(result.lengths[row])].tolist()
        assert ours == ref
