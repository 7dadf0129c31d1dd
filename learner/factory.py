"""Choose the train step for the configured algorithm: the GRPO family or PPO with a critic."""
from __future__ import annotations

import functools

from learner.config import LearnerConfig
from learner.models.llama import forward
from learner.ppo import PPOTrainStep
from learner.train_step import TrainStep


def make_train_step(graphdef, cfg: LearnerConfig):
    """A train step object with init(params), update(state, microbatches, num_tokens),
    set_hyperparams(state, **kw), get_hyperparams(state) and cache_sizes().

    cfg.algorithm "grpo": TrainStep (state: LearnerState); "ppo": PPOTrainStep (state: PPOState,
    which also carries the critic, its optimizer and the frozen reference policy). Both states
    expose .params (the policy to publish), .opt_state and .step.
    """
    if cfg.algorithm == "ppo":
        return PPOTrainStep(graphdef, cfg)
    if cfg.algorithm == "grpo":
        return TrainStep(functools.partial(forward, graphdef), cfg)
    raise ValueError(f"algorithm: must be 'grpo' or 'ppo', got {cfg.algorithm!r}")
