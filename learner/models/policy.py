"""Where the policy comes from: the built-in tiny Llama (default) or a Hugging Face checkpoint.

`build_policy(cfg)` is the one place that decides the model config, weights and tokenizer, so
the engine, the learner and the tasks all see the same ones. With ``model.path=DIR`` the
architecture, weights and tokenizer come from the checkpoint there (model.param_dtype and
model.compute_dtype still apply); otherwise a random model of the configured shape with the
character tokenizer.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from cadence.learner.models.char_tokenizer import CharTokenizer
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.llama import abstract_params, init_params


@dataclasses.dataclass
class Policy:
    model_cfg: ModelConfig  # the architecture actually built (from config or from a checkpoint)
    graphdef: Any
    params: Any
    tokenizer: Any  # has pad_id, bos_id, eos_id, encode, decode (HFTokenizer: apply_chat_template)


def load_tokenizer(model_cfg: ModelConfig):
    """The tokenizer of the policy model_cfg describes: the checkpoint's, or CharTokenizer."""
    if model_cfg.path:
        from cadence.learner.models.hf_tokenizer import HFTokenizer

        return HFTokenizer(model_cfg.path)
    return CharTokenizer()


def resolve_model_config(model_cfg: ModelConfig) -> ModelConfig:
    """The ModelConfig actually built: read from the checkpoint when model.path is set."""
    if model_cfg.path:
        from cadence.learner.models.hf_config import model_config_from_checkpoint

        return model_config_from_checkpoint(model_cfg.path, model_cfg)
    return model_cfg


def build_policy(cfg, layout=None, tokenizer=None) -> Policy:
    """cfg: the whole launch Config (model section plus the learner's init seed).

    layout: a learner.sharding.Layout: the params come out on its mesh (a random init is built
    shard by shard on the devices; a checkpoint's tensors are read slice by slice, each process
    reading only what its devices hold, and placed straight onto their shards).
    tokenizer: this model's, already loaded (the run's preflight did, for its task); else loaded here.
    """
    if cfg.model.path:
        from cadence.learner.models.hf_load import load_checkpoint

        model_cfg, graphdef, params = load_checkpoint(cfg.model.path, cfg.model,
                                                      None if layout is None else layout.params)
        return Policy(model_cfg, graphdef, params, tokenizer or load_tokenizer(model_cfg))
    graphdef, params = init_params(cfg.model, cfg.learner.seed, None if layout is None else layout.params)
    return Policy(cfg.model, graphdef, params, tokenizer or CharTokenizer())


def policy_skeleton(cfg) -> Policy:
    """The policy without its weights: architecture, tokenizer, and params whose leaves are
    jax.ShapeDtypeStruct. What an actor process needs (its weights come from the learner): no
    random init to compile, no checkpoint to read."""
    model_cfg = resolve_model_config(cfg.model)
    graphdef, params = abstract_params(model_cfg)
    return Policy(model_cfg, graphdef, params, load_tokenizer(model_cfg))


def export_policy(policy: Policy, params, out_dir: str, **kwargs) -> list[str]:
    """Writes params as a Hugging Face directory (tokenizer files copied from model.path, if any).

    kwargs go to ``hf_export.export_checkpoint`` (e.g. max_shard_bytes). Returns the shard names.
    """
    from cadence.learner.models.hf_export import export_checkpoint

    return export_checkpoint(policy.model_cfg, params, out_dir, source=policy.model_cfg.path, **kwargs)
