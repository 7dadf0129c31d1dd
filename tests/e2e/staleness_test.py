"""With a deliberately slow learner, no update uses a sample older than max_staleness versions."""
import pytest

from cadence.launch.metrics import read_metrics
from cadence.launch.run.train import train
from tests.slow_learner import SlowLearner


@pytest.mark.parametrize("eta", [0, 2])
def test_slow_learner_never_trains_on_samples_beyond_the_bound(eta, small_config, tmp_path):
    cfg = small_config("run.steps=12", "run.eval_every=0", f"actors.max_staleness={eta}",
                       "actors.num_actors=2", "actors.prompts_per_call=4")
    train(cfg, str(tmp_path / "run"), wrap_train_step=lambda ts: SlowLearner(ts, 0.3))
    steps = [m for m in read_metrics(str(tmp_path / "run")) if m["step"] > 0]
    assert len(steps) == 12
    for m in steps:
        assert m["staleness/max"] <= eta, m
        assert sum(m["staleness/hist"]) == m["batch_size"] // 8  # one entry per group
    if eta == 0:
        assert all(m["staleness/mean"] == 0 for m in steps)  # synchronous: on-policy
    else:
        # the slow learner lets the actors run ahead: the bound is reached, not just respected
        assert max(m["staleness/max"] for m in steps) == eta
    # Admission keeps samples fresh, so the consumption-time filter has next to nothing to drop.
    # Not always nothing: groups arrive in the order actors finish, not the order they were
    # admitted, and a group admitted for the last step the bound allows that a later one overtakes
    # lands one step late. Many drops mean late deliveries (a lost wake in the actor's I/O thread
    # held its sends until heartbeats and failed this once), or a gate that lets the actors run
    # further ahead than the bound (then the filter drops most of what they make).
    dropped = [m["dropped_stale"] for m in steps]
    assert sum(dropped) < steps[0]["batch_size"] // 8, dropped  # under one batch of groups in 12
    # each actor reports the weights it generates with: its lag stays near the bound, not the step
    lags = [steps[-1][f"actor/actor-{i}/version_lag"] for i in range(2)]
    assert all(lag is not None and 0 <= lag <= eta + 2 for lag in lags), lags
