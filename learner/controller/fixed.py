"""The controller of a run whose batch size never changes (controller.enabled=false, the default).

    ctrl = FixedBatchSize(batch_size=64, concurrency=16)
    ctrl.course()             # Decision(batch_size=64, concurrency=16)
    ctrl.update(observation)  # None, always

It measures nothing and logs nothing; it only holds the course, so a resumed run continues at the
batch size and concurrency its checkpoint recorded (learner/controller/interface.py).
"""
from __future__ import annotations

from typing import Any

from cadence.learner.controller.interface import Decision, Observation


class FixedBatchSize:
    """B and the actors' concurrency as given; Adam as configured."""

    def __init__(self, batch_size: int, concurrency: int):
        if batch_size < 1 or concurrency < 1:
            raise ValueError(f"FixedBatchSize: batch_size and concurrency must be >= 1, got {batch_size}, "
                             f"{concurrency}")
        self.batch_size = batch_size
        self.concurrency = concurrency

    def course(self) -> Decision:
        return Decision(batch_size=self.batch_size, concurrency=self.concurrency)

    def update(self, observation: Observation) -> Decision | None:
        return None

    def metrics(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict:
        return {"batch_size": self.batch_size, "concurrency": self.concurrency}

    def load_state_dict(self, state: dict) -> None:
        self.batch_size = int(state["batch_size"])
        self.concurrency = int(state["concurrency"])
