"""One body, every controller: the interface of learner/controller/interface.py (a typed
Observation in, a typed Decision out, the course it owns, metrics, checkpoint state)."""
import json
import math

import pytest

from cadence.learner.config import LearnerConfig
from cadence.learner.controller import (
    AdamHyperparams,
    BatchSizeController,
    ControllerConfig,
    Decision,
    FixedBatchSize,
    Generation,
    GradientNorms,
    Observation,
    holding_controller,
    make_controller,
)
from tests.learner.controller_decision_test import Curve

LEARNER = LearnerConfig(batch_size=128, microbatch_size=16, group_size=8)
MULTIPLE = math.lcm(8, 16)


class Actors:
    processes, num_actors, max_staleness, prompts_per_call = 0, 2, 1, 16


def square_root():
    """The measured controller where growing pays: generation scales with concurrency, the learner
    has a fixed cost per step, and the gradients (below) give a large noise scale."""
    cfg = ControllerConfig(enabled=True, window=5, dwell=10, min_batch_size=16, max_batch_size=1024)
    return BatchSizeController(cfg, LEARNER, num_actors=2, generation=Curve(lambda c: 20.0 * c),
                               learner=Curve(lambda b: b / (0.5 + 0.001 * b)), concurrency=16)


IMPLEMENTATIONS = {
    "square_root": square_root,
    "holding": lambda: holding_controller(ControllerConfig(base_batch_size=64), LEARNER, Actors),
    "fixed": lambda: FixedBatchSize(128, 16),
}


def observation(step, batch_size, concurrency):
    """One update as the loop reports it: gradients whose two-batch estimate gives B_noise >> B."""
    mbs = batch_size // 16
    n_i, tokens = 10.0, 10.0 * mbs
    mean_sq = 1.0  # each microbatch's own mean gradient, squared
    big_sq = 1.05 * 16 / batch_size * mean_sq  # |G|^2 small next to tr(Sigma)
    grads = GradientNorms(grad_norm_sq=big_sq, microbatch_grad_norm_sq=(mean_sq * (n_i / tokens) ** 2,) * mbs,
                          microbatch_tokens=(n_i,) * mbs)
    return Observation(step=step, batch_size=batch_size, train_seconds=0.5 + 0.001 * batch_size, tokens=tokens,
                       gradients=grads, ess=0.9, clip_frac=0.05, staleness_mean=0.5, staleness_max=1,
                       learning_rate=1e-3,
                       generation=Generation(wall_time=float(step), tokens_per_second=1000.0,
                                             generate_seconds=0.8 * step, concurrency=concurrency))


def drive(ctrl, steps, start=1):
    """Feed updates the way learner.loop does: each at the course in force; returns the decisions."""
    decisions = []
    for step in range(start, start + steps):
        course = ctrl.course()
        d = ctrl.update(observation(step, course.batch_size, course.concurrency))
        metrics = ctrl.metrics()
        assert all(k.startswith("controller/") for k in metrics) and json.loads(json.dumps(metrics)) == metrics
        if d is not None:
            decisions.append((step, course, d))
    return decisions


@pytest.mark.parametrize("make", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS.keys())
def test_course_observation_decision_and_state(make):
    ctrl = make()
    start = ctrl.course()
    assert isinstance(start, Decision) and start.hyperparams is None
    assert (start.batch_size, start.concurrency) == (128, 16)
    decisions = drive(ctrl, 30)
    for step, before, d in decisions:
        assert isinstance(d, Decision) and isinstance(d.reason, str) and d.reason
        assert d.hyperparams is None or isinstance(d.hyperparams, AdamHyperparams)
        if d.batch_size is not None:
            assert d.batch_size % MULTIPLE == 0 and d.batch_size != before.batch_size
        if d.concurrency is not None:
            assert d.concurrency >= 1
    # The controller owns the course: after its last change, course() is what it decided.
    changes = [d for _, _, d in decisions if d.batch_size is not None]
    if changes:
        assert ctrl.course().batch_size == changes[-1].batch_size
    # A checkpoint's state continues in a fresh object exactly (JSON-safe, as checkpoints hold it).
    state = json.loads(json.dumps(ctrl.state_dict()))
    again = make()
    again.load_state_dict(state)
    assert again.course() == ctrl.course()
    assert drive(again, 10, start=31) == drive(ctrl, 10, start=31)


def test_the_implementations_behave_as_named():
    grows = [d for _, _, d in drive(square_root(), 30) if d.batch_size is not None]
    assert grows and grows[0].batch_size == 256 and grows[0].concurrency == 32
    assert grows[0].hyperparams.learning_rate == pytest.approx(LEARNER.optimizer.lr * math.sqrt(2))
    held = drive(IMPLEMENTATIONS["holding"](), 30)
    assert held and all(d.batch_size is None and d.concurrency is None for _, _, d in held)
    # base_batch_size 64 != 128: the rule's Adam values once, after the first update
    assert held[0][0] == 1 and held[0][2].hyperparams.learning_rate == pytest.approx(LEARNER.optimizer.lr * math.sqrt(2))
    assert drive(FixedBatchSize(128, 16), 30) == []


@pytest.mark.parametrize("make", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS.keys())
def test_a_course_only_state_starts_there(make):
    # A checkpoint of a run whose batch size was fixed holds only the course.
    ctrl = make()
    ctrl.load_state_dict({"batch_size": 64, "concurrency": 4})
    assert (ctrl.course().batch_size, ctrl.course().concurrency) == (64, 4)


def test_make_controller_picks_by_config():
    assert isinstance(make_controller(ControllerConfig(enabled=True), LEARNER, Actors), BatchSizeController)
    assert isinstance(make_controller(ControllerConfig(base_batch_size=64), LEARNER, Actors), BatchSizeController)
    fixed = make_controller(ControllerConfig(), LEARNER, Actors)
    assert isinstance(fixed, FixedBatchSize) and fixed.course() == Decision(batch_size=128, concurrency=16)
