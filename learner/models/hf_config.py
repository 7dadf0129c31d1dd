"""Hugging Face ``config.json`` <-> ModelConfig for the Llama, Qwen2 and Qwen3 families.

Reading is strict: an architecture or option the Flax model does not implement (sliding-window
attention, MLP biases, a RoPE scaling other than Llama 3's, a non-SiLU activation) raises
ValueError naming it, instead of loading a model that silently computes something else.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from cadence.learner.models.config import ModelConfig

# HF architecture name -> family. Qwen2's attention always has q/k/v biases; Llama's and Qwen3's
# follow `attention_bias` (which then covers o_proj too).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def read_config_json(path: str) -> dict[str, Any]:
    """Reads DIR/config.json (raises FileNotFoundError naming the file)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json in checkpoint directory {path!r}")
    with open(file) as f:
        return json.load(f)


def architecture_of(hf: dict[str, Any]) -> str:
    """The checkpoint's architecture name, e.g. "Qwen2ForCausalLM".

    Raises:
      ValueError: naming the architecture (or model_type) when it is not supported.
    """
    names = hf.get("architectures") or []
    if not names and hf.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[hf["model_type"]]]
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        shown = names or hf.get("model_type")
        raise ValueError(
            f"unsupported architecture {shown!r}; supported: {sorted(ARCHITECTURES)}")
    return names[0]


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from either the v4 keys or transformers v5's rope_parameters."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta), dict(scaling)


def model_config_from_hf(hf: dict[str, Any], base: ModelConfig = ModelConfig()) -> ModelConfig:
    """Builds the ModelConfig that reproduces a Hugging Face config.

    Args:
      hf: the parsed config.json.
      base: supplies what a checkpoint does not decide: param_dtype, compute_dtype and path.

    Returns:
      A validated ModelConfig; max_seq_len is the checkpoint's max_position_embeddings.

    Raises:
      ValueError: on an unsupported architecture or option (the message names it).
    """
    arch = architecture_of(hf)
    family = ARCHITECTURES[arch]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act {act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
        raise ValueError(f"{arch}: mlp_bias=true is not supported")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{arch}: use_sliding_window=true (sliding-window attention) is not supported")
    theta, scaling = _rope(hf)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{arch}: rope scaling type {rope_type!r} is not supported (only 'llama3')")
    attention_bias = bool(hf.get("attention_bias", False))
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or d_model // n_heads)
    fields = dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        d_ff=int(hf["intermediate_size"]),
        max_seq_len=int(hf.get("max_position_embeddings", base.max_seq_len)),
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", family != "llama")),
        head_dim_override=0 if head_dim * n_heads == d_model else head_dim,
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        qk_norm=family == "qwen3",
    )
    if rope_type == "llama3":
        fields.update(
            rope_scaling_type="llama3",
            rope_scaling_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    cfg = dataclasses.replace(base, **fields)
    cfg.validate()
    return cfg


def model_config_from_checkpoint(path: str, base: ModelConfig = ModelConfig()) -> ModelConfig:
    """``model_config_from_hf`` of DIR/config.json, with ``path`` set to DIR."""
    return model_config_from_hf(read_config_json(path), dataclasses.replace(base, path=path))


def family_of(cfg: ModelConfig) -> str:
    """The HF family whose modeling code computes what cfg does: qwen3, qwen2 or llama."""
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias and not cfg.o_bias:
        return "qwen2"
    return "llama"


def hf_from_model_config(cfg: ModelConfig, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config.json dict for cfg: the source checkpoint's (keeping its other keys) or a fresh one.

    Args:
      cfg: the model's config.
      source: the config.json the model was loaded from, if any; its unrelated keys (token ids,
        initializer range, ...) are kept and the architecture fields are overwritten from cfg.

    Returns:
      A JSON-serialisable dict with ``torch_dtype``/``dtype`` set to cfg.param_dtype.
    """
    family = family_of(cfg)
    out = dict(source) if source else {"architectures": [_MODEL_TYPES[family]], "model_type": family}
    if not source:
        out["hidden_act"] = "silu"
    out.update(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        intermediate_size=cfg.d_ff,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        torch_dtype=cfg.param_dtype,
        dtype=cfg.param_dtype,
    )
    if family != "qwen2":
        out["attention_bias"] = cfg.o_bias
    scaling = {"rope_type": "default"}
    if cfg.rope_scaling_type == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position_embeddings,
        }
    # Both spellings: transformers v4 reads rope_theta/rope_scaling, v5 reads rope_parameters.
    out["rope_theta"] = cfg.rope_theta
    out["rope_scaling"] = None if cfg.rope_scaling_type == "none" else scaling
    out["rope_parameters"] = {**scaling, "rope_theta": cfg.rope_theta}
    return out
