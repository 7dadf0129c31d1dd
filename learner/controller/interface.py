"""The controller's interface: a typed observation in after every update, a typed decision out.

The controller is the one owner of the batch size B (samples per update), Adam's hyperparameters
and the actors' concurrency (prompts per engine call). The learner loop, the admission gate and the
dispatcher hold what it decided and apply it; nobody else sets them.

    controller = make_controller(cfg.controller, cfg.learner, cfg.actors)  # or FixedBatchSize(64, 16)
    start = controller.course()              # a Decision with batch_size and concurrency set
    gate = AdmissionGate(start.batch_size, max_staleness)
    loop = LearnerLoop(train_step, transport, gate, weights, settings, controller=controller)

    # after each update (LearnerLoop.run does this):
    decision = controller.update(Observation(step=7, batch_size=64, train_seconds=0.41, tokens=2310,
                                             ess=0.93, clip_frac=0.02, staleness_mean=0.6,
                                             generation=Generation(wall_time=35.2, tokens_per_second=5400.0,
                                                                   generate_seconds=61.0, concurrency=16)))
    record.update(controller.metrics())      # its estimates, e.g. controller/noise_scale, for metrics.jsonl
    if decision is not None:                 # B to the loop and gate, Adam through inject_hyperparams,
        state = loop.apply(state, decision)  # concurrency to the dispatcher; nothing recompiles

    decision = controller.fit(120, "mesh of 3 row devices")  # a restart on other devices: B 128 -> 120

    checkpoint_meta["controller"] = controller.state_dict()   # a resume: controller.load_state_dict(...)

Implementations: BatchSizeController (learner/controller/controller.py: measures, decides by
the rule in docs/controller.md, rescales Adam by the square-root rule; `BatchSizeController.holding`
is the same with B fixed, for runs that only measure) and FixedBatchSize (learner/controller/fixed.py:
the course it was given, always). tests/learner/controller_interface_test.py runs one body over each.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class AdamHyperparams:
    """Adam's values to use from the next update on (set through optax.inject_hyperparams)."""

    learning_rate: float
    b1: float
    b2: float
    eps: float

    def as_kwargs(self) -> dict[str, float]:
        """{"learning_rate", "b1", "b2", "eps"}: the train step's set_hyperparams(**kwargs)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the controller asks for after an update (None: leave as is), and why."""

    batch_size: int | None = None  # samples per update from the next update on
    hyperparams: AdamHyperparams | None = None
    concurrency: int | None = None  # prompts per engine call for the actors
    reason: str = ""  # logged as controller/decision


@dataclasses.dataclass(frozen=True)
class Generation:
    """The generation side at the end of an update, as the dispatcher counts it."""

    wall_time: float  # the run's clock (seconds)
    tokens_per_second: float  # completion tokens received per second since the previous update
    generate_seconds: float  # engine time summed over actors since the run started (cumulative)
    concurrency: int  # the actors' prompts per engine call in force now


@dataclasses.dataclass(frozen=True)
class GradientNorms:
    """Squared gradient norms of one update, as the train step reports them (noise-scale input)."""

    grad_norm_sq: float  # |g|^2 of the accumulated batch gradient, before clipping
    # each microbatch's contribution to g (normalized by the batch's loss tokens), squared
    microbatch_grad_norm_sq: tuple[float, ...]
    microbatch_tokens: tuple[float, ...]  # loss tokens of each microbatch
    # The same over whole-group units (runs of microbatches holding whole GRPO groups, the noise
    # estimate's small batches: learner/controller/noise.py); empty when the update had none.
    unit_grad_norm_sq: tuple[float, ...] = ()  # each unit's contribution to g, squared
    unit_share: tuple[float, ...] = ()  # its share of the loss normalizer (tokens, or sequences)
    unit_samples: tuple[int, ...] = ()  # samples in each unit
    # |g|^2 of the whole batch under the objective the units were measured on, where that is not
    # the trained one (ControllerConfig.noise_objective "unclipped"); None: grad_norm_sq.
    unit_batch_grad_norm_sq: float | None = None


@dataclasses.dataclass(frozen=True)
class Observation:
    """One update, as the controller sees it. Optional fields are None when not measured."""

    step: int  # the policy version this update produced (1, 2, ...)
    batch_size: int  # samples the update trained on
    train_seconds: float | None = None  # host time of the update (microbatches built, step run)
    tokens: float = 0.0  # loss (completion) tokens of the batch
    computed_fraction: float | None = None  # of the batch's microbatches, the share given a gradient pass
    # (learner.skip_zero_advantage skips those whose groups have equal rewards); None: all
    gradients: GradientNorms | None = None
    ess: float | None = None  # effective sample size fraction of the importance weights
    clip_frac: float | None = None  # fraction of tokens whose ratio was clipped
    staleness_mean: float | None = None  # mean policy versions between sampling and this update
    staleness_max: int | None = None
    learning_rate: float | None = None  # the one this update used
    generation: Generation | None = None


class Controller(Protocol):
    """Owns B, Adam's hyperparameters and the actors' concurrency (see the module docstring)."""

    def course(self) -> Decision:
        """The batch size and concurrency in force now (both set; hyperparams None: the optimizer
        state holds them): where a run starts, or resumes after load_state_dict."""
        ...

    def update(self, observation: Observation) -> Decision | None:
        """Measure one update; a Decision to change course (or a logged hold), else None."""
        ...

    def fit(self, multiple: int, reason: str) -> Decision | None:
        """The learner's mesh changed and B must now be a multiple of `multiple` (group size x the
        re-planned microbatch, learner/row_plan.py): the course moves to the nearest such B, with
        the scaling rule's Adam values from the reference point; returns that Decision (applied
        like any other, its reason logged as controller/decision), or None when B already fits."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Its estimates from the last update for the run's metrics ("controller/..." keys)."""
        ...

    @property
    def gradient_units(self) -> int:
        """Whole-group units per batch it wants gradient norms of (Observation.gradients.unit_*:
        the learner lays the batch out so no microbatch straddles two); 0: none."""
        ...

    def gradient_objective(self, step: int, off_policy: bool) -> str | None:
        """What update `step`'s gradient norms are to measure (off_policy: its batch holds samples
        of an older policy): "trained" (parts of the trained gradient), "unclipped" (of the
        objective without its clip, a pass of their own: ControllerConfig.noise_objective), or
        None (nothing this update: its Observation then has no gradients)."""
        ...

    def state_dict(self) -> dict:
        """Everything needed to continue as if nothing happened (JSON-serializable)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict returned."""
        ...
