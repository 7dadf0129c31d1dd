"""The batch-size controller: measurements, decision rule, square-root rescaling (docs/controller.md)."""
from cadence.learner.controller.config import ControllerConfig
from cadence.learner.controller.controller import BatchSizeController
from cadence.learner.controller.scaling import rescale, scaled_learner, scaled_optimizer


def make_controller(cfg: ControllerConfig, learner_cfg, actors_cfg):
    """A learner.loop.Controller, or None when the controller is off (the default).

    Off but with controller.base_batch_size set to another batch than learner.batch_size, a
    controller that never changes B still applies the scaling rule's hyperparameters (after step 1).
    """
    engines = max(actors_cfg.processes or actors_cfg.num_actors, 1)  # generation engines in parallel
    if not cfg.enabled:
        if cfg.base_batch_size and cfg.base_batch_size != learner_cfg.batch_size:
            import dataclasses
            fixed = dataclasses.replace(cfg, min_batch_size=learner_cfg.batch_size,
                                        max_batch_size=learner_cfg.batch_size, scale_concurrency=False,
                                        min_ess=0.0, max_clip_frac=1.0)
            return BatchSizeController(fixed, learner_cfg, engines, actors_cfg.max_staleness > 0)
        return None
    return BatchSizeController(cfg, learner_cfg, engines, actors_cfg.max_staleness > 0)


__all__ = ["BatchSizeController", "ControllerConfig", "make_controller", "rescale", "scaled_learner", "scaled_optimizer"]
