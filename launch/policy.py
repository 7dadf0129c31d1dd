"""Where the policy comes from: the built-in tiny Llama (default) or, later, a checkpoint path.

`build_policy(cfg)` is the one place that decides the model config, weights and tokenizer, so
the engine, the learner and the tasks all see the same ones.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from learner.models.char_tokenizer import CharTokenizer
from learner.models.config import ModelConfig
from learner.models.llama import init_params


@dataclasses.dataclass
class Policy:
    model_cfg: ModelConfig  # the architecture actually built (from config or from a checkpoint)
    graphdef: Any
    params: Any
    tokenizer: Any  # has pad_id, bos_id, eos_id, encode, decode


def build_policy(cfg) -> Policy:
    """cfg: the whole launch Config (model section plus the learner's init seed)."""
    graphdef, params = init_params(cfg.model, cfg.learner.seed)
    return Policy(cfg.model, graphdef, params, CharTokenizer())
