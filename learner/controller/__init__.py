"""The batch-size controller (issue: measurements, decision rule, square-root rescaling)."""
from learner.controller.config import ControllerConfig


def make_controller(cfg: ControllerConfig, learner_cfg, actors_cfg):
    """A learner.loop.Controller, or None when the controller is off (the default)."""
    if not cfg.enabled:
        return None
    raise NotImplementedError("controller.enabled=true: the batch-size controller is not built yet")
