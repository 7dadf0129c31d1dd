"""Configuration of the batch-size controller."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    enabled: bool = False  # resize the batch while training (off: fixed learner.batch_size)

    def validate(self) -> None:
        pass
