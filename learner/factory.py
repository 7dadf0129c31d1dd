"""Choose the train step for the configured algorithm (GRPO today; PPO plugs in here)."""
from __future__ import annotations

import functools

from learner.config import LearnerConfig
from learner.models.llama import forward
from learner.train_step import TrainStep


def make_train_step(graphdef, cfg: LearnerConfig):
    """A train step object with init(params), update(state, microbatches, num_tokens),
    set_hyperparams(state, **kw) and cache_sizes()."""
    return TrainStep(functools.partial(forward, graphdef), cfg)
