"""Crash loops told apart from a few restarts (launch/cluster/restart_budget.py), and the error a
failed process's last run ended with, read from its gathered log."""
from cadence.launch.cluster.restart_budget import RestartBudget, last_error


def test_more_restarts_than_the_budget_within_the_window_is_a_crash_loop():
    b = RestartBudget(2, 60.0)
    for t in (0.0, 10.0):
        b.restarted("actor-0", t)
    assert b.exceeded(11.0) is None  # two restarts: within the budget
    b.restarted("actor-1", 12.0)
    b.restarted("actor-0", 20.0)
    assert b.exceeded(21.0) == "actor-0"
    assert b.exceeded(65.0) is None  # the first restart left the window


def test_restarts_spread_over_time_never_exceed_it_and_zero_means_no_budget():
    b = RestartBudget(2, 60.0)
    for t in range(0, 1000, 40):
        b.restarted("actor-0", float(t))
        assert b.exceeded(float(t)) is None
    off = RestartBudget(0, 60.0)
    for t in range(10):
        off.restarted("actor-0", float(t))
    assert off.exceeded(10.0) is None


def test_the_last_error_is_the_last_failed_runs_own():
    marker = "[ray host actor-0] process exited with 1; the host exits for Ray to restart it"
    log = "\n".join([
        "loading", "Traceback (most recent call last):", "  File x", "RuntimeError: the first run's", marker,
        "Fatal Python error: init_fs_encoding: failed", "Python runtime state: core initialized",
        "ModuleNotFoundError: No module named 'encodings'", "", "Current thread 0x1 (most recent call first):",
        "  <no Python frame>", marker,
        "a new run, still going",  # the run after the last failed one
    ])
    assert last_error(log) == "ModuleNotFoundError: No module named 'encodings'"
    assert last_error("no error here\nexiting\n") == "exiting"
    assert last_error("") == "(no output gathered)"
