"""The batch-size controller: its interface, the measured controller and the fixed one (docs/controller.md)."""
from cadence.learner.controller.config import ControllerConfig
from cadence.learner.controller.controller import BatchSizeController
from cadence.learner.controller.fixed import FixedBatchSize
from cadence.learner.controller.interface import (
    AdamHyperparams,
    Controller,
    Decision,
    Generation,
    GradientNorms,
    Observation,
)
from cadence.learner.controller.scaling import optimizer_hyper, rescale, scaled_learner, scaled_optimizer


def make_controller(cfg: ControllerConfig, learner_cfg, actors_cfg) -> Controller:
    """The run's controller: BatchSizeController with controller.enabled, else one that holds
    learner.batch_size: FixedBatchSize, or, when controller.base_batch_size names another batch
    than learner.batch_size, `holding_controller` (it applies the scaling rule's Adam values once,
    after step 1)."""
    if cfg.enabled:
        return BatchSizeController(cfg, learner_cfg, _engines(actors_cfg), actors_cfg.max_staleness > 0,
                                   concurrency=actors_cfg.prompts_per_call)
    if cfg.base_batch_size and cfg.base_batch_size != learner_cfg.batch_size:
        return holding_controller(cfg, learner_cfg, actors_cfg)
    return FixedBatchSize(learner_cfg.batch_size, actors_cfg.prompts_per_call,
                          optimizer_hyper(learner_cfg.optimizer), cfg.scaling, cfg.max_scaled_batch_size)


def holding_controller(cfg: ControllerConfig, learner_cfg, actors_cfg) -> BatchSizeController:
    """A BatchSizeController that never changes B or the concurrency but measures (the noise scale
    and throughput estimates land in metrics.jsonl); with cfg.base_batch_size set to another batch,
    it applies the rule's Adam values after step 1. The experiments' fixed runs use it with
    base_batch_size=0 (their config already holds the rescaled values)."""
    return BatchSizeController.holding(cfg, learner_cfg, _engines(actors_cfg), actors_cfg.max_staleness > 0,
                                       concurrency=actors_cfg.prompts_per_call)


def _engines(actors_cfg) -> int:
    """Generation engines in parallel: actor processes, else actor threads."""
    return max(actors_cfg.processes or actors_cfg.num_actors, 1)


__all__ = ["AdamHyperparams", "BatchSizeController", "Controller", "ControllerConfig", "Decision", "FixedBatchSize",
           "Generation", "GradientNorms", "Observation", "holding_controller", "make_controller", "rescale",
           "scaled_learner", "scaled_optimizer"]
