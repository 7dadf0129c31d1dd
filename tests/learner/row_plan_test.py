"""Rows per device re-planned for the mesh a learner got (learner/row_plan.py), and the controllers'
fit of the batch size to it with the square-root rule's Adam values."""
import math

import pytest

from cadence.learner.config import LearnerConfig
from cadence.learner.controller import (BatchSizeController, ControllerConfig, FixedBatchSize, holding_controller,
                                        make_controller)
from cadence.learner.row_plan import nearest_multiple, plan_microbatch, plan_packed_rows, plan_rows

DEFAULT = LearnerConfig()  # batch 128, microbatch 32, group 8


class Actors:
    processes, num_actors, max_staleness, prompts_per_call = 0, 2, 1, 16


def test_nearest_multiple_keeps_a_batch_that_fits_and_otherwise_moves_least_in_ratio():
    assert nearest_multiple(128, 32) == 128
    assert nearest_multiple(128, 120) == 120  # 128/120 < 240/128
    assert nearest_multiple(32, 24) == 24  # 32/24 < 48/32
    assert nearest_multiple(10, 24) == 24  # never zero
    assert nearest_multiple(12, 8) == 16  # in ratio 16/12 is nearer than 12/8
    assert nearest_multiple(36, 24) == 48  # 48/36 < 36/24


def test_a_mesh_the_microbatch_splits_over_changes_nothing():
    for rows in (1, 2, 4, 8, 16, 32):
        plan = plan_rows(DEFAULT, rows)
        assert plan.learner == DEFAULT and plan.notes == ()


def test_three_row_devices_get_a_microbatch_of_multiples_of_three_no_larger_than_configured():
    # the case: `cadence train learner.processes=3` with the defaults
    plan = plan_rows(DEFAULT, 3)
    m = plan.learner.microbatch_size
    assert m == 30 and m % 3 == 0 and m <= 32
    assert nearest_multiple(DEFAULT.batch_size, math.lcm(8, m)) == 120  # B moves 128 -> 120 (the nearest)
    assert plan.learner.batch_size == 128  # the configured B stays the rescale's reference point
    assert plan.learner.sft.batch_size == 63  # the warm-up's 64 rows split too
    assert any("microbatch_size 32 -> 30" in n for n in plan.notes)


def test_the_batch_size_is_kept_when_some_split_microbatch_divides_it():
    # B = 96, 3 devices: 24 divides 96 (B kept) where 30 would force B = 120
    assert plan_microbatch(32, 96, 8, 3) == 24
    # a small batch: the microbatch that keeps B nearest, not the largest split
    assert plan_microbatch(32, 32, 8, 3) == 24
    # more devices than the microbatch has rows: one row per device
    assert plan_microbatch(4, 64, 8, 6) == 6
    # minibatches: every optimizer update keeps a microbatch of its own
    m = plan_microbatch(32, 128, 8, 3, minibatches=4)
    assert nearest_multiple(128, math.lcm(8, m)) // m >= 4


def test_packed_rows_are_replanned_to_split_over_the_row_devices():
    cfg = LearnerConfig(microbatch_tokens=4 * 64)  # 4 rows of seq_len 64
    assert plan_packed_rows(cfg, 64, 2).learner == cfg
    plan = plan_packed_rows(cfg, 64, 3)
    assert plan.learner.microbatch_tokens == 3 * 64 and plan.notes


def test_the_fixed_controller_refits_b_with_the_square_root_rule():
    ctrl = make_controller(ControllerConfig(), plan_rows(DEFAULT, 3).learner, Actors)
    assert isinstance(ctrl, FixedBatchSize)
    d = ctrl.fit(120, "3 devices")
    assert d.batch_size == 120 and ctrl.course().batch_size == 120 and "refit B 128 -> 120" in d.reason
    k = 120 / 128
    h = d.hyperparams
    assert h.learning_rate == pytest.approx(DEFAULT.optimizer.lr * math.sqrt(k))
    assert (h.b1, h.b2, h.eps) == pytest.approx((0.9 ** k, 0.99 ** k, 1e-8 / math.sqrt(k)))
    assert ctrl.fit(120, "again") is None  # it fits now
    # back on 4 devices (a resumed run whose checkpoint says 120): exactly the configured values
    ctrl.load_state_dict({"batch_size": 120, "concurrency": 16})
    back = ctrl.fit(32, "4 devices")
    assert back.batch_size == 128 and back.hyperparams.as_kwargs() == pytest.approx(
        {"learning_rate": 1e-3, "b1": 0.9, "b2": 0.99, "eps": 1e-8})


@pytest.mark.parametrize("make", [
    lambda lc: BatchSizeController(ControllerConfig(enabled=True), lc, concurrency=16),
    lambda lc: holding_controller(ControllerConfig(base_batch_size=64), lc, Actors),
], ids=["measured", "holding"])
def test_the_measured_controllers_refit_from_their_reference_point_and_log_it(make):
    ctrl = make(plan_rows(DEFAULT, 3).learner)
    base = ctrl.base_batch_size
    d = ctrl.fit(120, "3 devices")
    assert d.batch_size == 120 and ctrl.course().batch_size == 120
    assert d.hyperparams.learning_rate == pytest.approx(DEFAULT.optimizer.lr * math.sqrt(120 / base))
    assert ctrl.decisions[-1]["action"] == "refit" and ctrl.state_dict()["decisions"][-1]["new_batch_size"] == 120
    assert ctrl.multiple == 120  # later decisions choose among batch sizes that split too


def test_fixed_without_hyperparameters_moves_b_only():
    d = FixedBatchSize(128, 16).fit(120, "3 devices")
    assert d.batch_size == 120 and d.hyperparams is None
