"""Decision rule: hand-made throughput curves and noise scales; grow, shrink, hold; no flapping."""
import dataclasses

import numpy as np
import pytest

from cadence.learner.config import LearnerConfig
from cadence.learner.controller import BatchSizeController, ControllerConfig, Generation, GradientNorms, Observation
from cadence.learner.controller.decision import candidate_batch_sizes, choose_batch_size, time_to_target_score
from cadence.learner.controller.throughput import (Contention, GenerationThroughput, LearnerThroughput,
                                                   pipeline_throughput)

LEARNER = LearnerConfig(batch_size=128, microbatch_size=16, group_size=8)


class Curve:
    """A fixed throughput curve (samples/s) standing in for a fitted model (a constructor argument
    of BatchSizeController; tests/learner/controller_interface_test.py uses it too)."""

    computed_fraction = 1.0  # as LearnerThroughput's: the whole batch computed

    def __init__(self, fn):
        self.fn = fn

    def observe(self, *args):
        pass

    def predict(self, x):
        return self.fn(x)

    def curve(self):
        return None

    cost = curve

    def batch_sizes(self):
        return []  # a given curve, not measurements: nothing to probe

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Noise:
    """A noise-scale estimate that the test sets (or draws) directly."""

    def __init__(self, value):
        self.value = value
        self.grad_sq = self.trace_sigma = None

    @property
    def noise_scale(self):
        return self.value() if callable(self.value) else self.value

    @property
    def noise_scale_interval(self):  # resolved: the range is the point
        v = self.noise_scale
        return None if v is None else (v, v)

    def update_from_gradients(self, *a):
        return True


def make(noise, gen, learn, **cfg):
    c = ControllerConfig(**{"enabled": True, "window": 5, "dwell": 10, "min_batch_size": 16,
                            "max_batch_size": 1024, "hysteresis": 0.1, **cfg})
    return BatchSizeController(c, LEARNER, generation=Curve(gen), learner=Curve(learn), noise=Noise(noise))


def drive(ctrl, steps, ess=0.9, clip=0.05, stale=0.5):
    """Feed `steps` updates the way learner.loop does; returns B per step and the decisions."""
    b, c, sizes, changes = 128, 16, [], []
    for step in range(1, steps + 1):
        d = ctrl.update(Observation(step=step, batch_size=b, ess=ess, clip_frac=clip, staleness_mean=stale,
                                    learning_rate=1e-3, generation=Generation(step * 1.0, 0.0, 0.0, c)))
        if d is not None and d.batch_size is not None:
            changes.append((step, b, d.batch_size))
            b = d.batch_size
        if d is not None and d.concurrency is not None:
            c = d.concurrency
        sizes.append(b)
    return sizes, changes, c


def drive_timed(ctrl, steps, learner_time, b=128):
    """Updates whose learner takes learner_time(B) seconds (generation unlimited); returns the last
    B and the changes as (step, action, B, new B)."""
    actions = []
    for step in range(1, steps + 1):
        d = ctrl.update(Observation(step=step, batch_size=b, train_seconds=learner_time(b), ess=0.9, clip_frac=0.0,
                                    generation=Generation(step * 1.0, 0.0, 0.0, 16)))
        if d is not None and d.batch_size is not None:
            actions.append((step, ctrl.decisions[-1]["action"], b, d.batch_size))
            b = d.batch_size
    return b, actions


def memory_bound(c):  # generation: linear in concurrency (prompts per call) up to far beyond
    return 20.0 * c


def saturated(c):  # generation: flat
    return 500.0


def learner_fixed_cost(b):  # t_step = 0.5 s + 1 ms per sample
    return b / (0.5 + 0.001 * b)


def test_grows_while_throughput_gain_beats_the_sample_penalty():
    ctrl = make(10_000.0, memory_bound, learner_fixed_cost)
    sizes, changes, c = drive(ctrl, 60)
    assert changes[0] == (10, 128, 256)  # first decision after the dwell
    assert all(new == 2 * old for _, old, new in changes)
    assert sizes[-1] == 1024 and c == 16 * 8  # up to B_max, concurrency following B
    # the rule in numbers at the first change
    x = lambda b: pipeline_throughput(memory_bound(16 * b / 128), learner_fixed_cost(b), True)
    assert time_to_target_score(256, 1e4, x(256)) < 0.9 * time_to_target_score(128, 1e4, x(128))
    gaps = np.diff([s for s, _, _ in changes])
    assert (gaps >= 10).all()  # dwell respected


def test_a_scaling_ceiling_stops_growth_where_the_withheld_lr_costs_more_than_throughput_buys():
    """The growth case above, with the rule stopped at B = 512 (k = 4 from 128): at 1024 the rule's
    lr would be 2.83x the base, it gets 2x, and E(1024) is taken 1.41x larger; X(1024)/X(512) =
    1.33 does not pay for that, and B stays at 512 on 512's Adam values."""
    ctrl = make(10_000.0, memory_bound, learner_fixed_cost, max_scaled_batch_size=512)
    sizes, changes, _ = drive(ctrl, 60)
    assert [c[1:] for c in changes] == [(128, 256), (256, 512)] and sizes[-1] == 512
    x = lambda b: pipeline_throughput(memory_bound(16 * b / 128), learner_fixed_cost(b), True)
    want = (1 + 1024 / 1e4) * np.sqrt(2) / x(1024) / ((1 + 512 / 1e4) / x(512))  # NumPy reference
    assert ctrl.decisions[-1]["scores"]["1024"] == pytest.approx(want, rel=1e-9) and want > 1.0
    assert ctrl.hyperparams_for(1024) == ctrl.hyperparams_for(512)
    assert time_to_target_score(1024, 1e4, 2.0, lr_shortfall=1.5) == pytest.approx(1.5 * (1 + 1024 / 1e4) / 2.0)


def test_shrinks_when_throughput_is_flat_and_noise_scale_small():
    ctrl = make(32.0, saturated, lambda b: 1e6)
    sizes, changes, _ = drive(ctrl, 60)
    assert changes[0][1:] == (128, 64)
    assert sizes[-1] == 16  # down to B_min: E(B) grows with B and X does not
    assert all(new == old // 2 for _, old, new in changes)


def test_holds_inside_the_hysteresis_margin():
    # Generation throughput rises 1.5x on doubling; B_noise = 173 makes E(2B)/E(B) = 1.425, so
    # 2B is predicted 5% faster: inside the 10% margin. (B/2 is 18% slower.)
    gen = lambda c: 100.0 * 1.5 ** np.log2(c / 16)
    ctrl = make(173.0, gen, lambda b: 1e6)
    sizes, changes, _ = drive(ctrl, 60)
    assert changes == [] and set(sizes) == {128}
    assert ctrl.decisions and all(d["action"] == "hold" for d in ctrl.decisions)
    assert "B=256 only 5.0% faster (hysteresis" in ctrl.decisions[-1]["reason"]
    # without the margin the same inputs do grow
    ctrl0 = make(173.0, gen, lambda b: 1e6, hysteresis=0.0)
    assert drive(ctrl0, 60)[1][0][1:] == (128, 256)


def test_hysteresis_and_dwell_prevent_flapping_on_noisy_inputs():
    # B_noise near the break-even point of B=128 vs 256 (X doubles on doubling B: break-even at
    # E(2B)/E(B) = 2, never; so use X ratio 1.5: break-even B_noise = B), drawn with 30% noise.
    gen = lambda c: 100.0 * 1.5 ** np.log2(c / 16)
    rng = np.random.default_rng(0)
    noisy = lambda: 128.0 * float(np.exp(rng.normal(0, 0.3)))
    flappy = make(noisy, gen, lambda b: 1e6, hysteresis=0.0, dwell=0, window=1)
    _, changes_flappy, _ = drive(flappy, 200)
    rng = np.random.default_rng(0)
    calm = make(noisy, gen, lambda b: 1e6)
    _, changes_calm, _ = drive(calm, 200)
    assert len(changes_flappy) > 20  # the noise alone would flip B back and forth
    assert len(changes_calm) <= len(changes_flappy) / 5
    assert len(changes_calm) <= 200 // 10  # never more often than the dwell allows
    reversals = sum(1 for a, b in zip(changes_calm, changes_calm[1:]) if (a[2] > a[1]) != (b[2] > b[1]))
    assert reversals <= 3


def test_guards_hold_b_and_lower_concurrency():
    ctrl = make(10_000.0, memory_bound, learner_fixed_cost, min_ess=0.5)
    sizes, changes, c = drive(ctrl, 30, ess=0.2)
    assert changes == [] and set(sizes) == {128}
    assert c < 16  # concurrency halved first
    assert any("ESS" in d["reason"] for d in ctrl.decisions)
    ctrl = make(10_000.0, memory_bound, learner_fixed_cost, max_clip_frac=0.2)
    assert drive(ctrl, 30, clip=0.5)[1] == []
    # staleness guard: predicted lag (0.5 * B / B') times the grown lr must stay under the bound
    ctrl = make(10_000.0, memory_bound, learner_fixed_cost, max_staleness_lr=1e-4)
    sizes, changes, _ = drive(ctrl, 30, stale=0.5)
    assert changes == []  # 2B: lag 0.25 x lr 1.41e-3 = 3.5e-4 > 1e-4
    ctrl = make(10_000.0, memory_bound, learner_fixed_cost, max_staleness_lr=1e-3)
    assert drive(ctrl, 30, stale=0.5)[1][0][1:] == (128, 256)


def test_no_noise_scale_means_hold():
    ctrl = make(None, memory_bound, learner_fixed_cost)
    assert drive(ctrl, 30)[1] == []
    assert "noise scale not measurable" in ctrl.decisions[-1]["reason"]


def test_choose_and_candidates():
    assert candidate_batch_sizes(128, 16, 1024, 16) == [64, 128, 256]
    assert candidate_batch_sizes(16, 16, 1024, 16) == [16, 32]
    assert candidate_batch_sizes(48, 16, 1024, 16) == [48, 96]  # 24 is not a multiple of 16
    best, scores = choose_batch_size(128, [64, 128, 256], 64.0, lambda b: 100.0, 0.1)
    assert best == 64 and scores[64] == pytest.approx((1 + 1) / (1 + 2)) and scores[128] == 1.0


def test_fitted_models_recover_hand_made_curves():
    gen = GenerationThroughput(num_engines=2)
    r1, c_sat = 3.0, 32.0
    for c in (4, 8, 16, 32, 64):
        for _ in range(3):
            gen.observe(c, c * r1 / (1 + c / c_sat))
    fit_r1, fit_sat = gen.curve()
    assert fit_r1 == pytest.approx(r1, rel=1e-6) and fit_sat == pytest.approx(c_sat, rel=1e-6)
    assert gen.predict(128) == pytest.approx(2 * 128 * r1 / (1 + 128 / c_sat))
    learn = LearnerThroughput()
    for b in (32, 64, 128):
        learn.observe(b, 0.2 + 0.003 * b)
    assert learn.cost() == pytest.approx((0.2, 0.003))
    assert learn.predict(256) == pytest.approx(256 / (0.2 + 0.003 * 256))
    one = LearnerThroughput()
    one.observe(64, 0.64)
    assert one.cost() == pytest.approx((0.0, 0.01))  # one B: no fixed cost can be separated
    assert pipeline_throughput(100.0, 50.0, True) == 50.0
    assert pipeline_throughput(100.0, 100.0, False) == pytest.approx(50.0)


def test_the_learner_cost_is_per_computed_sample_when_flat_groups_are_skipped():
    """learner.skip_zero_advantage: an update's time follows the share of its batch given a
    gradient pass (f), which follows the reward, not B. B = 16 timed early (f = 0.25) and B = 32
    later (f = 0.5), t = 0.5 s + 10 ms per computed sample: the fit on computed samples recovers
    the hand-made cost, and X(B) is predicted at the recent updates' f."""
    t_fix, t_sample = 0.5, 0.01
    learn, blind = LearnerThroughput(decay=0.8), LearnerThroughput(decay=0.8)
    fractions = [0.25] * 6 + [0.5] * 6
    for i, f in enumerate(fractions):
        b = 16 if i < 6 else 32
        learn.observe(b, t_fix + t_sample * b * f, computed_fraction=f)
        blind.observe(b, t_fix + t_sample * b * f)  # as if every update computed its whole batch
    assert learn.cost() == pytest.approx((t_fix, t_sample))
    # the recent updates' f: an EMA (decay 0.8) over all updates, bias-corrected
    w = 0.8 ** np.arange(len(fractions))[::-1]
    f_now = float(np.sum(w * fractions) / np.sum(w))
    assert learn.computed_fraction == pytest.approx(f_now)
    assert learn.predict(64) == pytest.approx(64 / (t_fix + 64 * f_now * t_sample))
    # blind to f, the two points read as a smaller per-sample cost and a fixed cost near 0.42 s
    slope, intercept = np.polyfit([16, 32], [t_fix + t_sample * 4, t_fix + t_sample * 16], 1)
    assert blind.cost() == pytest.approx((intercept, slope)) and slope == pytest.approx(0.0075)
    # nothing computed yet (every group flat): the per-sample cost is unmeasured, not zero
    flat = LearnerThroughput()
    flat.observe(16, 0.4, computed_fraction=0.0)
    assert flat.cost() is None and flat.predict(16) is None
    flat.observe(16, 0.9, computed_fraction=0.5)
    assert flat.cost()[1] > 0
    # a checkpoint from before the fraction was kept restores with f = 1
    old = LearnerThroughput()
    old.load_state_dict({"ema": learn.state_dict()["ema"]})
    assert old.computed_fraction == 1.0 and old.cost() == pytest.approx(blind.cost())
    again = LearnerThroughput()
    again.load_state_dict(learn.state_dict())
    assert again.cost() == learn.cost() and again.predict(64) == learn.predict(64)


def test_the_controller_takes_the_computed_fraction_from_the_learner_s_metrics():
    from cadence.learner.loop import observation

    m = {"batch_size": 32, "learner/train_seconds": 2.0, "skipped_microbatches": 3, "num_microbatches": 12}
    assert observation(5, m).computed_fraction == pytest.approx(0.75)
    assert observation(5, {"batch_size": 32}).computed_fraction is None  # nothing skipped: all computed
    ctrl = BatchSizeController(ControllerConfig(enabled=True, warmup_steps=0), LEARNER)
    for step in range(1, 4):
        ctrl.update(observation(step, m))
    assert ctrl.learner.computed_fraction == pytest.approx(0.75)
    assert ctrl.learner.cost() == pytest.approx((0.0, 2.0 / (32 * 0.75)))


def test_contention_weighs_the_faster_side_between_overlap_and_alternation():
    assert pipeline_throughput(100.0, 50.0, True, contention=0.0) == 50.0  # overlapped: the slower side
    assert pipeline_throughput(100.0, 50.0, True, contention=1.0) == pytest.approx(1 / (1 / 100 + 1 / 50))
    assert pipeline_throughput(100.0, 50.0, True, contention=0.5) == pytest.approx(1 / (1 / 50 + 0.5 / 100))
    assert pipeline_throughput(100.0, 50.0, False, contention=0.0) == pytest.approx(1 / (1 / 100 + 1 / 50))
    k = Contention(decay=0.5)
    assert k.value is None
    k.observe(1.5, 0.5, 1.0)  # wall = both sides' times: they took turns
    assert k.value == pytest.approx(1.0)
    k.observe(1.0, 0.5, 1.0)  # wall = the slower side's: they overlapped
    assert k.value == pytest.approx((0.5 * 1.0 + 1.0 * 0.0) / 1.5)  # the bias-corrected EMA of 1, 0
    for wall, k_want in ((3.0, 1.0), (0.2, 0.0), (1.25, 0.5)):  # clipped to [0, 1]
        one = Contention()
        one.observe(wall, 1.0, 0.5)
        assert one.value == pytest.approx(k_want)
    one.observe(1.0, 0.0, 1.0)  # no generation time measured: nothing learned
    assert one.value == pytest.approx(0.5)


@pytest.mark.parametrize("wall, grows", [(1.0, False), (1.5, True)])
def test_sides_that_take_turns_make_a_memory_bound_generator_worth_a_larger_batch(wall, grows):
    """The learner's rate is flat in B; generation is memory-bound (its rate grows with the
    concurrency, which follows B). Where the sides overlap (each update's wall = the slower side's
    time) the pipeline runs at the learner's rate whatever B: nothing to gain, B holds. Where they
    take turns on shared cores (wall = both times), generation's cost per sample falls with B and
    the controller, having measured that, grows B (B_noise far above)."""
    ctrl = make(1e4, memory_bound, lambda b: 100.0)
    b, c, busy, clock, sizes = 128, 16, 0.0, 0.0, []
    for step in range(1, 31):
        busy, clock = busy + 0.5, clock + wall  # per update: generation 0.5 s, learner 1.0 s
        d = ctrl.update(Observation(step=step, batch_size=b, ess=0.9, clip_frac=0.05, staleness_mean=0.5,
                                    learning_rate=1e-3, train_seconds=1.0, tokens=1000.0,
                                    generation=Generation(clock, 100.0, busy, c)))
        if d is not None and d.batch_size is not None:
            b, c = d.batch_size, d.concurrency or c
        sizes.append(b)
    assert ctrl.contention.value == pytest.approx(1.0 if grows else 0.0)
    assert (max(sizes) > 128) == grows, (sizes, ctrl.decisions[-1]["reason"])
    assert ctrl.metrics()["controller/contention"] == pytest.approx(ctrl.contention.value)


def test_state_dict_round_trip_continues_identically():
    import json

    a = BatchSizeController(ControllerConfig(enabled=True, window=2, dwell=0, warmup_steps=0), LEARNER)
    rng = np.random.default_rng(1)
    def observation(step):
        grads = GradientNorms(0.2, tuple(rng.uniform(1, 2, 8) / 64), (10.0,) * 8)
        return Observation(step=step, batch_size=128, gradients=grads, tokens=80, ess=0.9, clip_frac=0.0,
                           train_seconds=0.3 + 0.01 * step,
                           generation=Generation(wall_time=step * 1.0, tokens_per_second=500.0,
                                                 generate_seconds=step * 0.8, concurrency=16))
    for s in range(1, 6):
        a.update(observation(s))
    b = BatchSizeController(ControllerConfig(enabled=True, window=2, dwell=0, warmup_steps=0), LEARNER)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # JSON-safe, as a checkpoint holds it
    assert b.state_dict() == json.loads(json.dumps(a.state_dict()))
    obs = observation(6)
    da, db = a.update(obs), b.update(obs)
    assert da == db and a.noise.noise_scale == b.noise.noise_scale and a.metrics() == b.metrics()
    assert a.contention.value is not None and b.contention.value == a.contention.value


def test_one_group_per_update_probes_the_next_batch_size_for_a_noise_scale():
    """At B = G (one GRPO group) there are no two whole-group units to compare, so the noise
    scale can never be measured there: instead of holding forever, the first decision after the
    dwell moves to 2B, where it can (and where the learner's time gets its second point)."""
    learner = LearnerConfig(batch_size=8, microbatch_size=8, group_size=8)
    cfg = ControllerConfig(enabled=True, window=4, dwell=8, min_batch_size=8, max_batch_size=64, warmup_steps=0)
    ctrl = BatchSizeController(cfg, learner, concurrency=4)
    one_unit = GradientNorms(0.3, (0.2, 0.1), (30.0, 30.0), unit_grad_norm_sq=(0.3,), unit_share=(1.0,),
                             unit_samples=(8,))
    changes = []
    for step in range(1, 13):
        d = ctrl.update(Observation(step=step, batch_size=8, gradients=one_unit, tokens=60.0, train_seconds=2.0,
                                    ess=0.9, clip_frac=0.0,
                                    generation=Generation(step * 3.0, 20.0, step * 1.0, 4)))
        if d is not None and d.batch_size is not None:
            changes.append((step, d.batch_size, d.concurrency, d.reason))
    assert ctrl.noise.noise_scale is None and ctrl.noise.count == 0  # never the split microbatches
    assert [c[:3] for c in changes] == [(8, 16, 8)]  # after the dwell; concurrency follows B
    assert changes[0][3].startswith("probe B 8 -> 16: one group per update")
    assert [e["action"] for e in ctrl.decisions] == ["hold", "probe", "hold"]  # dwell, probe, dwell
    # switched off, it holds and says why
    off = BatchSizeController(dataclasses.replace(cfg, probe=False), learner, concurrency=4)
    for step in range(1, 13):
        assert off.update(Observation(step=step, batch_size=8, gradients=one_unit, tokens=60.0)) is None or \
            off.decisions[-1]["action"] == "hold"
    assert "noise scale not measurable" in off.decisions[-1]["reason"]


def test_learner_time_at_one_batch_size_is_probed_once_then_the_rule_uses_the_fixed_cost():
    """With one measured B the learner's model has no fixed cost (X flat in B), and a rule fed
    that never grows for the learner's sake. The controller spends one dwell at B/2, fits
    t = t_fix + B t_sample from the two points, and decides from that (here: larger B pays)."""
    learner_time = lambda b: 2.0 + 0.01 * b  # seconds: a large fixed cost
    ctrl = BatchSizeController(ControllerConfig(enabled=True, window=5, dwell=10, min_batch_size=16,
                                                max_batch_size=1024, hysteresis=0.1, warmup_steps=0),
                               LEARNER, generation=Curve(lambda c: 1e6), noise=Noise(1e4))
    b, actions = drive_timed(ctrl, 40, learner_time)
    assert actions[0] == (10, "probe", 128, 64)
    assert [a for _, a, _, _ in actions].count("probe") == 1  # once: two points measured from then on
    t_fix, t_sample = ctrl.learner.cost()
    assert t_fix == pytest.approx(2.0, rel=1e-6) and t_sample == pytest.approx(0.01, rel=1e-6)
    # 2B pays by the margin (grow), or is predicted faster within it where X(2B) is unmeasured (explore)
    assert [a for _, a, _, _ in actions[1:]][:1] == ["grow"] and b > 256
    assert {a for _, a, _, _ in actions[1:]} <= {"grow", "explore"}


class RangeNoise(Noise):
    """A noise scale known only from below: |G|^2 within noise of 0, the range (low, inf)."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    @property
    def noise_scale_interval(self):
        return (self.value, float("inf"))


@pytest.mark.parametrize("explore", [True, False])
def test_an_unmeasured_batch_size_predicted_faster_at_the_range_s_other_end_is_explored_once(explore):
    """B_noise >= 40, unbounded: growing pays only if B_noise is large, and the learner's X at 2B is
    an extrapolation. The controller moves there once to measure (each B once), where without
    exploration it holds B forever on the pessimistic end. (B starts at the floor, so the learner's
    probe goes up.)"""
    learner_time = lambda b: 2.0 + 0.01 * b
    ctrl = BatchSizeController(ControllerConfig(enabled=True, window=5, dwell=10, min_batch_size=128,
                                                max_batch_size=1024, hysteresis=0.1, warmup_steps=0,
                                                explore=explore),
                               LEARNER, generation=Curve(lambda c: 1e6), noise=RangeNoise(40.0))
    b, actions = drive_timed(ctrl, 80, learner_time)
    actions = [a[1:] for a in actions]
    assert actions[0] == ("probe", 128, 256)  # the learner timed at one B first
    if not explore:
        assert actions == [("probe", 128, 256)]
        assert "current B is fastest" in ctrl.decisions[-1]["reason"]
        return
    assert actions[1:] == [("explore", 256, 512), ("explore", 512, 1024)]  # each once, up to max_batch_size
    assert ctrl.explored == {512, 1024}
    # with the rule stopped at 512, 1024 would train at 1/1.41 of the rule's lr: even at B_noise's
    # hopeful end its X gain (1.16x) does not pay for that, so it is not explored
    capped = BatchSizeController(dataclasses.replace(ctrl.cfg, max_scaled_batch_size=512), LEARNER,
                                 generation=Curve(lambda c: 1e6), noise=RangeNoise(40.0))
    assert [a[1:] for a in drive_timed(capped, 80, learner_time)[1]] == [("probe", 128, 256), ("explore", 256, 512)]
    reason = next(d["reason"] for d in ctrl.decisions if d["action"] == "explore")
    assert "never timed at 512" in reason and "B_noise >= 40" in reason
    restored = BatchSizeController(ctrl.cfg, LEARNER, generation=Curve(lambda c: 1e6), noise=RangeNoise(40.0))
    restored.load_state_dict(ctrl.state_dict())
    assert restored.explored == {512, 1024}


@pytest.mark.parametrize("noise_scale", [50.0, 1e4])
def test_the_learner_probe_goes_to_half_the_batch_and_up_only_from_the_floor(noise_scale):
    """The learner's second point is measured at B/2, whatever the rule would say of 2B: the
    scaling rule's lr falls with B, where at 2B it rises past any the run has trained with
    (sort-6 from B = 256 probed 512, whose sqrt-scaled lr stalls learning, and lost the time).
    From the floor (min_batch_size) it goes to 2B."""
    def first_move(min_batch_size):
        ctrl = BatchSizeController(ControllerConfig(enabled=True, window=5, dwell=10, min_batch_size=min_batch_size,
                                                    max_batch_size=1024, hysteresis=0.1, warmup_steps=0),
                                   LEARNER, generation=Curve(lambda c: 1e6), noise=Noise(noise_scale))
        return drive_timed(ctrl, 10, lambda b: 2.0 + 0.01 * b)[1]

    assert first_move(16) == [(10, "probe", 128, 64)]
    assert first_move(128) == [(10, "probe", 128, 256)]
