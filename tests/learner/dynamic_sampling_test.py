"""Dynamic sampling through the learner loop's real collect(): full batches, only zero-variance drops."""

import dataclasses
import threading
from typing import Any, NamedTuple

import numpy as np
import pytest

from cadence.learner.config import GRPOConfig, LearnerConfig
from cadence.learner.dynamic_sampling import (ZERO_VARIANCE, DynamicSamplingFilter, has_zero_advantage_variance,
                                      make_group_filter)
from cadence.learner.loop import LearnerLoop, LoopSettings
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.transport import InProcessTransport

G = 4


class Group(NamedTuple):
    prompt_id: str
    rewards: list
    policy_version: int = 0
    prompt_tokens: list = [1]
    completion_tokens: Any = None
    behavior_logprobs: Any = None


class Prompt(NamedTuple):
    prompt_id: str
    index: int


def _send(loop, transport, g, index):
    """What an actor does: the prompt is issued, then its group queued and sent."""
    loop.ledger.issue([Prompt(g.prompt_id, index)])
    loop.ledger.queue(g)
    transport.put(g)


def _loop(batch_size, filt, queue=1000):
    gate = AdmissionGate(batch_size, max_staleness=100)
    transport = InProcessTransport(maxsize=queue)
    settings = LoopSettings(G, G, 8, 0, GRPOConfig())
    loop = LearnerLoop(None, transport, gate, None, settings, group_filter=filt)
    return loop, transport, gate


def _random_groups(n, seed, p_constant=0.6):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if rng.random() < p_constant:
            rewards = [float(rng.integers(0, 2))] * G  # all solved or all failed
        else:
            rewards = [float(x) for x in rng.integers(0, 2, G)]
            rewards[0], rewards[1] = 0.0, 1.0  # at least two distinct values
        out.append(Group(f"p{i}", rewards))
    return out


def test_zero_variance_test_matches_the_advantages():
    from cadence.learner.algorithms.grpo import group_advantages
    for rewards in ([0.1, 0.1, 0.1], [1.0, 0.0, 0.0], [0.3, 0.3000001, 0.3], [2.0]):
        adv = group_advantages(np.asarray([rewards], np.float32))
        assert has_zero_advantage_variance(rewards) == bool(np.all(adv == 0)), rewards


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_collect_is_never_under_full_and_drops_only_zero_variance_groups(seed):
    batch_size = 8 * G
    filt = DynamicSamplingFilter(max_consecutive_drops=10_000)
    loop, transport, gate = _loop(batch_size, filt)
    groups = _random_groups(300, seed)
    for i, g in enumerate(groups):
        _send(loop, transport, g, i)
    taken = []
    for _ in range(3):
        batch = loop.collect()
        assert sum(len(g.rewards) for g in batch.groups) == batch_size  # exactly full
        assert all(not has_zero_advantage_variance(g.rewards) for g in batch.groups)
        taken += batch.groups
    # Every group seen was either kept or dropped as zero-variance; none with signal was lost.
    seen = groups[: groups.index(taken[-1]) + 1]
    kept_ids = {g.prompt_id for g in taken}
    for g in seen:
        assert (g.prompt_id in kept_ids) != has_zero_advantage_variance(g.rewards), g
    dropped = sum(has_zero_advantage_variance(g.rewards) for g in seen)
    assert loop.dropped == {ZERO_VARIANCE: dropped} and filt.dropped == dropped > 0
    # Dropped samples freed their admission credits: consumed = trained + dropped.
    assert gate.consumed == 3 * batch_size + dropped * G
    # ... and the sample ledger counts them by reason.
    assert loop.ledger.counts()["dropped_by_reason"] == {ZERO_VARIANCE: dropped}


def test_dropping_frees_admission_so_actors_keep_drawing():
    # With a tight gate (max_staleness 0), an actor can only admit one batch worth of samples until
    # the learner takes or drops some; the filter's drops must let it draw replacements.
    batch_size = 2 * G
    filt = DynamicSamplingFilter()
    gate = AdmissionGate(batch_size, max_staleness=0)
    transport = InProcessTransport(maxsize=100)
    loop = LearnerLoop(None, transport, gate, None, LoopSettings(G, G, 8, 0, GRPOConfig()), group_filter=filt)
    stop = threading.Event()
    source = iter(_random_groups(1000, seed=5, p_constant=0.7))
    admitted = []

    def actor():
        while not stop.is_set():
            if gate.admit(G, lambda: 0, timeout=0.05) is None:
                continue
            g = next(source)
            admitted.append(g)
            _send(loop, transport, g, len(admitted))

    t = threading.Thread(target=actor, daemon=True)
    t.start()
    try:
        batch = loop.collect(stop)
    finally:
        stop.set()
        t.join(timeout=5)
    assert sum(len(g.rewards) for g in batch.groups) == batch_size
    assert loop.dropped.get(ZERO_VARIANCE, 0) == filt.dropped
    assert filt.dropped >= 1  # it had to draw past dropped groups


def test_guard_keeps_a_group_after_too_many_drops():
    filt = DynamicSamplingFilter(max_consecutive_drops=3)
    flat = Group("c", [1.0] * G)
    assert [filt(flat) for _ in range(4)] == [ZERO_VARIANCE] * 3 + [None]
    assert filt.guard_kept == 1 and filt.dropped == 3
    assert filt(Group("s", [0.0, 1.0, 0.0, 0.0])) is None and filt.consecutive_drops == 0


def test_make_group_filter_follows_the_config():
    assert make_group_filter(LearnerConfig()) is None
    cfg = LearnerConfig(grpo=dataclasses.replace(GRPOConfig(), dynamic_sampling=True, max_consecutive_drops=7))
    filt = make_group_filter(cfg)
    assert isinstance(filt, DynamicSamplingFilter) and filt.max_consecutive_drops == 7
    with pytest.raises(ValueError, match="max_consecutive_drops"):
        dataclasses.replace(GRPOConfig(), max_consecutive_drops=0).validate()
