"""The one rule every launcher applies when its learner ends (launch_state.end_or_restart)."""
import types

from cadence.launch.cluster import launch_state


def _driver(max_restarts=2):
    said = []
    return types.SimpleNamespace(state="running", learner_restarts=0, run_dir="/runs/r",
                                 launch=types.SimpleNamespace(max_restarts=max_restarts), message=said.append), said


def test_exit_statuses_read_as_cadence_train_writes_them():
    assert launch_state.learner_exit(0, "lost") == "finished"
    assert launch_state.learner_exit(2, "lost") == "config"
    assert launch_state.learner_exit(3, "lost") == "already finished"
    assert launch_state.learner_exit(-9, "learner-0 exited with -9") == "learner-0 exited with -9"


def test_finished_and_stopped_end_with_0_and_a_bad_config_or_finished_run_is_never_restarted():
    for outcome in ("finished", "stopped"):
        d, _ = _driver()
        assert launch_state.end_or_restart(d, outcome, "learner group") == 0 and d.state == outcome
    for outcome, code in (("config", 2), ("already finished", 3)):
        d, said = _driver()
        assert launch_state.end_or_restart(d, outcome, "learner group") == code
        assert d.state == "failed" and d.learner_restarts == 0 and "not restarting" in said[0]


def test_a_lost_learner_restarts_until_launch_max_restarts_is_spent():
    d, said = _driver(max_restarts=2)
    assert launch_state.end_or_restart(d, "learner-1 exited with 1", "learner group") is None
    assert launch_state.end_or_restart(d, "node died", "learner group") is None
    assert said == ["learner group lost (learner-1 exited with 1); restart 1/2 from the newest checkpoint",
                    "learner group lost (node died); restart 2/2 from the newest checkpoint"]
    assert d.state == "running"
    assert launch_state.end_or_restart(d, "node died", "learner group") == 1
    assert d.state == "failed" and "launch.max_restarts=2" in said[-1]
