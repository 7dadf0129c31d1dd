"""Configuration of the generation side: how many actors, how much each asks of its engine."""
from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class ActorsConfig:
    engine: Literal["jax"] = "jax"  # generation engine: the built-in JAX sampler
    num_actors: int = 1  # actor threads, each with its own engine call in flight
    prompts_per_call: int = 16  # prompts per engine call (x group_size completions): the concurrency
    max_staleness: int = 1  # policy versions a sample may lag the step that trains on it; 0 = synchronous
    queue_size: int = 0  # bound on groups waiting for the learner (0 = no bound; admission bounds it anyway)
    seed: int = 0  # sampling RNG seed (actor i uses seed + i)

    def validate(self) -> None:
        if self.num_actors < 1:
            raise ValueError(f"num_actors: must be >= 1, got {self.num_actors}")
        if self.prompts_per_call < 1:
            raise ValueError(f"prompts_per_call: must be >= 1, got {self.prompts_per_call}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.queue_size < 0:
            raise ValueError(f"queue_size: must be >= 0, got {self.queue_size}")
