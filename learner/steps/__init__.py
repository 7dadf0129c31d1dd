"""The jitted train steps, one module each: grpo_step (the GRPO family), ppo_step (PPO with a critic),
sft_step (the supervised warm-up). `make_train_step` picks the RL one the config asks for."""
from __future__ import annotations

from cadence.learner.config import LearnerConfig
from cadence.learner.steps.ppo_step import PPOTrainStep
from cadence.learner.steps.grpo_step import GRPOTrainStep
from cadence.learner.steps.scoring import llama_logits


def make_train_step(graphdef, cfg: LearnerConfig, layout=None, *, completion_budget: int = 0,
                    temperature: float = 1.0):
    """A train step object with init(params), update(state, microbatches, num_tokens),
    set_hyperparams(state, **kw), get_hyperparams(state) and cache_sizes().

    cfg.algorithm "grpo": GRPOTrainStep (state: LearnerState); "ppo": PPOTrainStep (state: PPOState,
    which also carries the critic, its optimizer and the frozen reference policy). Both states
    expose .params (the policy to publish), .opt_state and .step. layout: a
    learner.sharding.Layout for a device mesh (None: one device); cfg.remat and cfg.logits_chunk
    apply either way.
    completion_budget (engine.max_new_tokens) divides the seq_sum_norm aggregation unless
    grpo.aggregation_constant is set; temperature (engine.temperature) is the sampler's, which the
    learner scores at.
    """
    if cfg.algorithm == "ppo":
        return PPOTrainStep(graphdef, cfg, layout, completion_budget=completion_budget, temperature=temperature)
    if cfg.algorithm == "grpo":
        return GRPOTrainStep(llama_logits(graphdef, cfg.remat), cfg, layout=layout,
                             completion_budget=completion_budget, temperature=temperature)
    raise ValueError(f"algorithm: must be 'grpo' or 'ppo', got {cfg.algorithm!r}")
