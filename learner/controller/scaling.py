"""Adam hyperparameters under a change of batch size B -> k B.

    sqrt    lr * sqrt(k), b_i ** k, eps / sqrt(k)   (Malladi et al. 2022; b**k ~ 1 - k(1 - b))
    linear  lr * k, betas and eps unchanged         (the SGD rule, for comparison)
    none    unchanged

Always computed from a reference point (the batch size the values were tuned at), never by
compounding factors step after step, so B -> 2B -> B returns exactly to the start.
"""
from __future__ import annotations

import dataclasses
import math

from cadence.learner.config import LearnerConfig, OptimizerConfig

HYPERPARAMS = ("learning_rate", "b1", "b2", "eps")


def rescale(hyper: dict[str, float], k: float, scaling: str) -> dict[str, float]:
    """The rule's hyperparameters after B -> k B.

    Args:
      hyper: {"learning_rate", "b1", "b2", "eps"} at the reference batch size.
      k: new batch size / reference batch size (> 0).
      scaling: "sqrt", "linear" or "none".

    Returns:
      A new dict with the same four keys.
    """
    if not k > 0:
        raise ValueError(f"k: must be > 0, got {k}")
    lr, b1, b2, eps = (float(hyper[n]) for n in HYPERPARAMS)
    if scaling == "sqrt":
        s = math.sqrt(k)
        return {"learning_rate": lr * s, "b1": b1 ** k, "b2": b2 ** k, "eps": eps / s}
    if scaling == "linear":
        return {"learning_rate": lr * k, "b1": b1, "b2": b2, "eps": eps}
    if scaling == "none":
        return {"learning_rate": lr, "b1": b1, "b2": b2, "eps": eps}
    raise ValueError(f"scaling: must be one of 'sqrt', 'linear', 'none', got {scaling!r}")


def optimizer_hyper(cfg: OptimizerConfig) -> dict[str, float]:
    """The four rescaled hyperparameters of an OptimizerConfig."""
    return {"learning_rate": cfg.lr, "b1": cfg.b1, "b2": cfg.b2, "eps": cfg.eps}


def scaled_optimizer(cfg: OptimizerConfig, base_batch_size: int, batch_size: int,
                     scaling: str) -> OptimizerConfig:
    """`cfg` (tuned at base_batch_size) with the rule's values for batch_size (fixed-B runs)."""
    h = rescale(optimizer_hyper(cfg), batch_size / base_batch_size, scaling)
    return dataclasses.replace(cfg, lr=h["learning_rate"], b1=h["b1"], b2=h["b2"], eps=h["eps"])


def scaled_learner(cfg: LearnerConfig, base_batch_size: int, batch_size: int, scaling: str) -> LearnerConfig:
    """`cfg` (tuned at base_batch_size) with the rule applied to every Adam in it: the policy's,
    and PPO's critic lr at its configured ratio to the policy's (it trains on the same batch)."""
    opt = scaled_optimizer(cfg.optimizer, base_batch_size, batch_size, scaling)
    if cfg.algorithm != "ppo":  # no critic: leave its unused settings as configured
        return dataclasses.replace(cfg, optimizer=opt)
    ppo = dataclasses.replace(cfg.ppo, critic_lr=cfg.ppo.critic_lr * opt.lr / cfg.optimizer.lr)
    return dataclasses.replace(cfg, optimizer=opt, ppo=ppo)
