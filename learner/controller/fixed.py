"""The controller of a run whose batch size never changes (controller.enabled=false, the default).

    ctrl = FixedBatchSize(batch_size=64, concurrency=16)
    ctrl.course()             # Decision(batch_size=64, concurrency=16)
    ctrl.update(observation)  # None, always

It measures nothing and logs nothing; it only holds the course, so a resumed run continues at the
batch size and concurrency its checkpoint recorded (learner/controller/interface.py). A learner
restarted on a mesh the batch does not split over moves it (`fit`), with the scaling rule's Adam
values computed from the batch size and hyperparameters it was constructed with.
"""
from __future__ import annotations

from typing import Any

from cadence.learner.controller.interface import AdamHyperparams, Decision, Observation
from cadence.learner.controller.scaling import max_k, rescale
from cadence.learner.row_plan import nearest_multiple


class FixedBatchSize:
    """B and the actors' concurrency as given; Adam as configured.

    hyperparams: {"learning_rate", "b1", "b2", "eps"} tuned at batch_size (the reference point of
    `fit`'s rescale; None: a fit moves B only); scaling: the rule ("sqrt", "linear", "none");
    max_scaled_batch_size: the rule stops there (0 = no ceiling).
    """

    def __init__(self, batch_size: int, concurrency: int, hyperparams: dict[str, float] | None = None,
                 scaling: str = "sqrt", max_scaled_batch_size: int = 0):
        if batch_size < 1 or concurrency < 1:
            raise ValueError(f"FixedBatchSize: batch_size and concurrency must be >= 1, got {batch_size}, "
                             f"{concurrency}")
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.base_batch_size, self.base_hyper, self.scaling = batch_size, hyperparams, scaling
        self.max_k = max_k(max_scaled_batch_size, batch_size)

    def course(self) -> Decision:
        return Decision(batch_size=self.batch_size, concurrency=self.concurrency)

    def update(self, observation: Observation) -> Decision | None:
        return None

    def fit(self, multiple: int, reason: str) -> Decision | None:
        b, new = self.batch_size, nearest_multiple(self.batch_size, multiple)
        if new == b:
            return None
        hyper = None
        if self.base_hyper is not None:
            hyper = AdamHyperparams(**rescale(self.base_hyper, new / self.base_batch_size, self.scaling, self.max_k))
        self.batch_size = new
        return Decision(batch_size=new, hyperparams=hyper,
                        reason=f"refit B {b} -> {new}: {reason}; scaling {self.scaling}")

    def metrics(self) -> dict[str, Any]:
        return {}

    @property
    def gradient_units(self) -> int:
        return 0  # it measures nothing

    def gradient_objective(self, step: int, off_policy: bool) -> str | None:
        return None

    def state_dict(self) -> dict:
        return {"batch_size": self.batch_size, "concurrency": self.concurrency}

    def load_state_dict(self, state: dict) -> None:
        self.batch_size = int(state["batch_size"])
        self.concurrency = int(state["concurrency"])
