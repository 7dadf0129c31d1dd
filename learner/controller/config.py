"""Configuration of the batch-size controller (decision rule, guards, Adam rescaling)."""
from __future__ import annotations

import dataclasses
from typing import Literal

SCALINGS = ("sqrt", "linear", "none")
NOISE_OBJECTIVES = ("unclipped", "trained")


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """When and how the learner's batch size B (samples per update) changes while training runs.

    The decision rule compares B/2, B, 2B by predicted time-to-target (1 + B/B_noise) / X(B) every
    `window` steps, at least `dwell` steps after the last change; see docs/controller.md.
    """

    enabled: bool = False  # resize the batch while training (off: fixed learner.batch_size)
    window: int = 10  # W: decide every this many updates (estimates are averaged over the window)
    dwell: int = 20  # minimum updates between two changes of B (>= window stops flapping)
    min_batch_size: int = 32  # B_min in samples (a multiple of group and microbatch size)
    max_batch_size: int = 1024  # B_max in samples
    hysteresis: float = 0.1  # switch only if predicted time-to-target drops by more than this fraction
    scaling: Literal["sqrt", "linear", "none"] = "sqrt"  # Adam rule on B -> kB (sqrt: lr*sqrt(k), b**k, eps/sqrt(k))
    base_batch_size: int = 0  # batch the optimizer hyperparameters are tuned for (0 = learner.batch_size)
    noise_ema: float = 0.9  # EMA decay of the two noise-scale terms (|G|^2 and tr(Sigma)), per step
    # Small batches of the noise estimate: units of whole GRPO groups (a part of a group carries
    # what only the whole group cancels: learner/controller/noise.py). Packed microbatches: the
    # batch cut into this many units, each filling microbatches of its own (<= 1 part-filled
    # microbatch more per unit); one sample per row: every place a group and a microbatch end
    # together (free). 0: the microbatches as they come.
    noise_units: int = 2
    # What the units' gradients are of on an update whose batch an older policy sampled (async):
    # under the coupled correction the trained objective's clip drops the tokens the last update
    # moved most, a systematic part the two-batch estimate reads as |G|^2 (sort-6: B_noise ~280
    # read where on-policy batches at the same params give 600-1,200, docs/controller.md).
    # "unclipped": those units come from the objective without its clip (same importance
    # weights: unbiased for the current policy's gradient), in a gradient pass of their own
    # (GRPO; PPO keeps its microbatches' trained norms); "trained": from the trained gradient
    # (free, biased low on stale batches). On-policy updates always use the trained gradient:
    # its ratio is 1 but for the sampler's mismatch, nothing for the clip to drop.
    noise_objective: Literal["unclipped", "trained"] = "unclipped"
    # Off-policy updates measure the noise scale every this many ("unclipped": the pass costs
    # one more gradient pass over the batch); the others give the estimate nothing. Sort-6 (its
    # learner the bottleneck on 2 cores): every update cost the runs 27-35% of their samples/s,
    # every 4th ~5%, with the same estimate (B_noise 1,007 vs 1,086) and decisions.
    noise_every: int = 4
    probe: bool = True  # move to the neighbouring B once where B alone cannot feed the rule (docs/controller.md)
    # Move once to a neighbouring B the learner was never timed at when the rule holds B but
    # that B is predicted faster at the other end of B_noise's range: the learner's time is
    # fitted as linear in B, and a prediction from other batch sizes can miss by more than the
    # margin (SmolLM2: 32 predicted <= 5% faster than 16, measured 27%). The rule then decides
    # from a measurement there.
    explore: bool = True
    warmup_steps: int = 2  # first updates ignored by the estimators (compilation, cold caches)
    min_ess: float = 0.5  # guard: no change of B while the mean ESS fraction is below this
    max_clip_frac: float = 0.3  # guard: no change of B while the mean clip fraction is above this
    max_staleness_lr: float = 0.0  # guard: predicted mean staleness * lr must stay <= this (0 = off)
    # The scaling rule follows B up to this batch size (0 = no ceiling): a larger B keeps its
    # Adam values, so it trains at less lr than the rule asks, and the rule takes its samples to
    # target as that many times larger (decision.py). Sort-6 (tuned at 128): B = 512 on the rule's
    # values reached the target in 2 of 3 seeds within 80k samples, on 256's in 3 of 3 at a median
    # 40.0k (docs/controller.md, "Where the rule stops").
    max_scaled_batch_size: int = 0
    scale_concurrency: bool = True  # actors' prompts per call follow B (x k on a change by k)
    max_concurrency: int = 128  # upper bound on the actors' prompts per call
    saturation_prior: float = 1.0  # c_sat / c assumed while only one concurrency has been measured

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>") on an out-of-range field."""
        for name in ("window", "min_batch_size", "max_batch_size", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.dwell < 0:
            raise ValueError(f"dwell: must be >= 0, got {self.dwell}")
        if self.max_batch_size < self.min_batch_size:
            raise ValueError(f"max_batch_size: must be >= min_batch_size ({self.min_batch_size}), "
                             f"got {self.max_batch_size}")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ValueError(f"hysteresis: must be in [0, 1), got {self.hysteresis}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling: must be one of {SCALINGS}, got {self.scaling!r}")
        if self.base_batch_size < 0:
            raise ValueError(f"base_batch_size: must be >= 0 (0 = learner.batch_size), got {self.base_batch_size}")
        if not 0.0 <= self.noise_ema < 1.0:
            raise ValueError(f"noise_ema: must be in [0, 1), got {self.noise_ema}")
        if self.noise_units == 1 or self.noise_units < 0:
            raise ValueError(f"noise_units: must be 0 (microbatches) or >= 2 (units of whole groups), "
                             f"got {self.noise_units}")
        if self.noise_objective not in NOISE_OBJECTIVES:
            raise ValueError(f"noise_objective: must be one of {NOISE_OBJECTIVES}, got {self.noise_objective!r}")
        if self.noise_every < 1:
            raise ValueError(f"noise_every: must be >= 1, got {self.noise_every}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_ess <= 1.0:
            raise ValueError(f"min_ess: must be in [0, 1], got {self.min_ess}")
        if not 0.0 <= self.max_clip_frac <= 1.0:
            raise ValueError(f"max_clip_frac: must be in [0, 1], got {self.max_clip_frac}")
        if self.max_staleness_lr < 0:
            raise ValueError(f"max_staleness_lr: must be >= 0 (0 = off), got {self.max_staleness_lr}")
        if self.max_scaled_batch_size < 0:
            raise ValueError(f"max_scaled_batch_size: must be >= 0 (0 = no ceiling), got {self.max_scaled_batch_size}")
        if not self.saturation_prior > 0:
            raise ValueError(f"saturation_prior: must be > 0, got {self.saturation_prior}")
