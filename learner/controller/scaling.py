"""Adam hyperparameters under a change of batch size B -> k B.

    sqrt    lr * sqrt(k), b_i ** k, eps / sqrt(k)   (Malladi et al. 2022; b**k ~ 1 - k(1 - b))
    linear  lr * k, betas and eps unchanged         (the SGD rule, for comparison)
    none    unchanged

Always computed from a reference point (the batch size the values were tuned at), never by
compounding factors step after step, so B -> 2B -> B returns exactly to the start.

A ceiling (`max_k`, from controller.max_scaled_batch_size / the reference batch; 0 = none) stops
the rule there: a larger batch keeps the values of k = max_k (never below the reference's own).
Past it a batch gets less lr than the rule asks, and `lr_shortfall` says by how much (the
decision rule's E(B) pays for it: decision.py). Sort-6 at B = 512 (k = 4): the rule's values
reached the target in 2 of 3 seeds within 80k samples, 256's lr with 512's betas in 3 of 3 at a
median 68.8k, all of 256's values in 3 of 3 at 40.0k (256 itself: 28.4k; docs/controller.md).
"""
from __future__ import annotations

import dataclasses
import math

from cadence.learner.config import LearnerConfig, OptimizerConfig
from cadence.learner.controller.config import SCALINGS

HYPERPARAMS = ("learning_rate", "b1", "b2", "eps")


def rescale(hyper: dict[str, float], k: float, scaling: str, max_k: float = 0.0) -> dict[str, float]:
    """The rule's hyperparameters after B -> k B.

    Args:
      hyper: {"learning_rate", "b1", "b2", "eps"} at the reference batch size.
      k: new batch size / reference batch size (> 0).
      scaling: "sqrt", "linear" or "none".
      max_k: the rule follows k up to max(max_k, 1) and keeps those values past it (0: no ceiling).

    Returns:
      A new dict with the same four keys.
    """
    if not k > 0:
        raise ValueError(f"k: must be > 0, got {k}")
    if scaling not in SCALINGS:
        raise ValueError(f"scaling: must be one of {SCALINGS}, got {scaling!r}")
    k = _capped(k, max_k)
    lr, b1, b2, eps = (float(hyper[n]) for n in HYPERPARAMS)
    if scaling == "sqrt":
        return {"learning_rate": lr * math.sqrt(k), "b1": b1 ** k, "b2": b2 ** k, "eps": eps / math.sqrt(k)}
    if scaling == "linear":
        return {"learning_rate": lr * k, "b1": b1, "b2": b2, "eps": eps}
    return {"learning_rate": lr, "b1": b1, "b2": b2, "eps": eps}


def lr_factor(k: float, scaling: str) -> float:
    """The factor the rule multiplies the reference lr by at B -> k B (no ceiling)."""
    return {"sqrt": math.sqrt(k), "linear": k, "none": 1.0}[scaling]


def lr_shortfall(k: float, scaling: str, max_k: float) -> float:
    """The rule's lr at B -> k B over the lr its ceiling gives (1: no ceiling, or at or under it)."""
    return lr_factor(k, scaling) / lr_factor(_capped(k, max_k), scaling)


def max_k(max_scaled_batch_size: int, base_batch_size: int) -> float:
    """controller.max_scaled_batch_size as a k from the reference batch (0: no ceiling)."""
    return max_scaled_batch_size / base_batch_size if max_scaled_batch_size > 0 else 0.0


def _capped(k: float, max_k: float) -> float:
    return min(k, max(max_k, 1.0)) if max_k > 0 else k


def optimizer_hyper(cfg: OptimizerConfig) -> dict[str, float]:
    """The four rescaled hyperparameters of an OptimizerConfig."""
    return {"learning_rate": cfg.lr, "b1": cfg.b1, "b2": cfg.b2, "eps": cfg.eps}


def scaled_optimizer(cfg: OptimizerConfig, base_batch_size: int, batch_size: int,
                     scaling: str, max_scaled_batch_size: int = 0) -> OptimizerConfig:
    """`cfg` (tuned at base_batch_size) with the rule's values for batch_size (fixed-B runs), the
    rule stopped at max_scaled_batch_size (0: no ceiling)."""
    h = rescale(optimizer_hyper(cfg), batch_size / base_batch_size, scaling,
                max_k(max_scaled_batch_size, base_batch_size))
    return dataclasses.replace(cfg, lr=h["learning_rate"], b1=h["b1"], b2=h["b2"], eps=h["eps"])


def scaled_learner(cfg: LearnerConfig, base_batch_size: int, batch_size: int, scaling: str,
                   max_scaled_batch_size: int = 0) -> LearnerConfig:
    """`cfg` (tuned at base_batch_size) with the rule applied to every Adam in it: the policy's,
    and PPO's critic lr at its configured ratio to the policy's (it trains on the same batch)."""
    opt = scaled_optimizer(cfg.optimizer, base_batch_size, batch_size, scaling, max_scaled_batch_size)
    if cfg.algorithm != "ppo":  # no critic: leave its unused settings as configured
        return dataclasses.replace(cfg, optimizer=opt)
    ppo = dataclasses.replace(cfg.ppo, critic_lr=cfg.ppo.critic_lr * opt.lr / cfg.optimizer.lr)
    return dataclasses.replace(cfg, optimizer=opt, ppo=ppo)
