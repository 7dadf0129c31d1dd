"""Admission in samples with B changing mid-run: no update uses a sample older than the bound.

A real run (actor threads, admission gate, learner loop) through launch.run.train.train with a
controller that grows and shrinks B between updates, and a slowed learner so the actors run as far
ahead as admission lets them.
"""

import pytest

from cadence.launch.config import load_config
from cadence.launch.metrics import read_metrics
from cadence.launch.run.train import train
from cadence.learner.controller import Decision, FixedBatchSize
from tests.slow_learner import SlowLearner

FAST = ["learner.sft.steps=5", "task.heldout_size=16", "run.progress=false", "run.eval_every=0",
        "learner.batch_size=32", "learner.microbatch_size=16", "actors.num_actors=2",
        "actors.prompts_per_call=2"]
SCHEDULE = {2: 64, 4: 16, 6: 48, 8: 32}  # after step s, B becomes SCHEDULE[s]


class Scripted(FixedBatchSize):
    """Changes B on a fixed schedule (the real controller's decisions come from measurements)."""

    def __init__(self):
        super().__init__(batch_size=32, concurrency=2)
        self.seen = []

    def update(self, obs):
        self.seen.append((obs.step, obs.batch_size))
        if obs.step in SCHEDULE:
            self.batch_size = SCHEDULE[obs.step]
            return Decision(batch_size=SCHEDULE[obs.step], reason=f"scripted B -> {SCHEDULE[obs.step]}")
        return None


@pytest.mark.parametrize("eta", [1, pytest.param(0, marks=pytest.mark.slow)])  # ~20 s each
def test_batch_size_changes_never_break_the_staleness_bound(eta, tmp_path):
    cfg = load_config(overrides=FAST + ["run.steps=10", f"actors.max_staleness={eta}"])
    ctrl = Scripted()
    train(cfg, str(tmp_path / "run"), controller=ctrl, wrap_train_step=lambda ts: SlowLearner(ts, 0.15))
    steps = [m for m in read_metrics(str(tmp_path / "run")) if m["step"] > 0]
    assert len(steps) == 10
    want, b = [], 32
    for s in range(1, 11):
        want.append(b)
        b = SCHEDULE.get(s, b)
    assert [m["batch_size"] for m in steps] == want  # the loop followed every change
    assert ctrl.seen == [(s, b) for s, b in zip(range(1, 11), want)]  # and the controller saw it, typed
    for m in steps:
        assert m["staleness/max"] <= eta, m
        assert sum(m["staleness/hist"]) == m["batch_size"] // 8
    if eta == 0:
        assert all(m["staleness/mean"] == 0 for m in steps)
    assert [m.get("controller/decision") for m in steps if m["step"] in SCHEDULE] == \
        [f"scripted B -> {SCHEDULE[s]}" for s in sorted(SCHEDULE)]
