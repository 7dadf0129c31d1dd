"""Learner sub-configs: optimizer, GRPO objective, supervised warm-up, and the learner itself.

Each is a frozen dataclass whose `validate()` raises ValueError("<field>: <problem>"); the config
loader prefixes the dotted key of the sub-config. `LearnerConfig.validate()` also validates its
nested sub-configs and prefixes their field names with the sub-config's key (e.g. "grpo.clip_low").
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Adam(W) with global-norm clipping; lr/b1/b2/eps can be changed between steps."""

    lr: float = 1e-3  # Adam learning rate (1e-3 reaches the sort-6 target fastest; 3e-3 diverges).
    b1: float = 0.9  # Adam first-moment decay.
    b2: float = 0.99  # Adam second-moment decay.
    eps: float = 1e-8  # Adam denominator epsilon.
    weight_decay: float = 0.0  # Decoupled weight decay (AdamW); 0 uses plain Adam.
    max_grad_norm: float = 1.0  # Global-norm gradient clipping threshold; 0 disables clipping.

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>") on an out-of-range field."""
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}: must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ValueError(f"eps: must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: must be >= 0 (0 disables), got {self.max_grad_norm}")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The GRPO objective: group advantages, clipped surrogate, off-policy correction."""

    scale_by_std: bool = True  # Divide group-centered rewards by the group std (False: Dr.GRPO).
    std_eps: float = 1e-6  # Added to the group std before dividing.
    clip_low: float = 0.2  # Lower clip: ratio is clipped at 1 - clip_low.
    clip_high: float = 0.2  # Upper clip: ratio is clipped at 1 + clip_high (clip-higher if larger).
    # How the sampler/learner mismatch is corrected: "decoupled" (AReaL: ratio vs the proximal
    # policy, times a truncated behavior importance weight), "coupled" (PPO ratio vs the sampler),
    # "none" (plain on-policy policy gradient; the behavior logprobs are only measured).
    correction: Literal["decoupled", "coupled", "none"] = "decoupled"
    is_cap: float = 2.0  # Truncation cap of the behavior importance weight; <= 0 disables the cap.
    temperature: float = 1.0  # Sampling temperature; the learner divides logits by it.
    entropy_coef: float = 0.0  # Weight of the token-mean entropy bonus (subtracted from the loss).

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>") on an out-of-range field."""
        if not self.std_eps >= 0:
            raise ValueError(f"std_eps: must be >= 0, got {self.std_eps}")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low: must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0:
            raise ValueError(f"clip_high: must be >= 0, got {self.clip_high}")
        if self.correction not in ("decoupled", "coupled", "none"):
            raise ValueError(
                f"correction: must be one of 'decoupled', 'coupled', 'none', got {self.correction!r}"
            )
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef: must be >= 0, got {self.entropy_coef}")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-up on answers before RL."""

    steps: int = 30  # Number of supervised updates.
    lr: float = 3e-3  # Fixed Adam learning rate of the warm-up (its own optimizer).
    batch_size: int = 64  # Examples per supervised update.

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>") on an out-of-range field."""
        if self.steps < 0:
            raise ValueError(f"steps: must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """The learner: batch geometry, objective, optimizer, warm-up."""

    batch_size: int = 128  # Samples per update (prompts x group_size).
    microbatch_size: int = 32  # Samples per jitted gradient accumulation step.
    group_size: int = 8  # Completions per prompt (G).
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)  # Adam(W).
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)  # The RL objective.
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)  # Supervised warm-up.
    seed: int = 0  # Seed of the learner's parameter init.

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>"); nested fields read "<sub>.<field>: ..."."""
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.microbatch_size < 1:
            raise ValueError(f"microbatch_size: must be >= 1, got {self.microbatch_size}")
        if self.group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {self.group_size}")
        if self.batch_size % self.microbatch_size:
            raise ValueError(
                f"batch_size: must be a multiple of microbatch_size ({self.microbatch_size}), "
                f"got {self.batch_size}"
            )
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size: must be a multiple of group_size ({self.group_size}), "
                f"got {self.batch_size}"
            )
        for key in ("optimizer", "grpo", "sft"):
            try:
                getattr(self, key).validate()
            except ValueError as err:
                raise ValueError(f"{key}.{err}") from None
