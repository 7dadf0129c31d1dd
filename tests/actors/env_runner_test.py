"""EnvRunner: environment calls run concurrently, each within its time limit; a hung one is given
up (and its thread replaced) without holding up the others."""
import threading
import time

import pytest

from cadence.actors.env_runner import EnvRunner


def test_calls_run_concurrently():
    # Every call waits for all the others: run one at a time they would break the barrier.
    barrier = threading.Barrier(6, timeout=10)
    out = EnvRunner(threads=6, timeout_s=30).map([lambda i=i: (barrier.wait(), i)[1] for i in range(6)])
    assert [o.value for o in out] == list(range(6)) and not any(o.timed_out or o.error for o in out)


def test_a_hung_call_is_given_up_at_its_limit_and_its_thread_replaced():
    hang = threading.Event()
    envs = EnvRunner(threads=2, timeout_s=0.5)
    t0 = time.monotonic()
    out = envs.map([hang.wait, lambda: 7, lambda: 1 / 0])
    assert time.monotonic() - t0 < 20  # not the hang's forever
    assert out[0].timed_out and out[0].value is None
    assert out[1].value == 7 and isinstance(out[2].error, ZeroDivisionError)
    assert envs.timeouts == 1 and envs.stuck == 1
    # the pool keeps its size: two calls that need each other still both run
    barrier = threading.Barrier(2, timeout=10)
    assert [o.value for o in envs.map([lambda: barrier.wait() * 0 + 1] * 2)] == [1, 1]
    hang.set()  # the given-up call returns at last; its thread ends
    deadline = time.monotonic() + 10
    while envs.stuck and time.monotonic() < deadline:
        time.sleep(0.05)
    assert envs.stuck == 0


def test_the_limit_counts_from_when_a_call_starts_not_while_it_waits_for_a_thread():
    # One thread, three calls of 0.8 s under a 2 s limit: the last is done 2.4 s after it was
    # handed in, but ran for only 0.8 s.
    out = EnvRunner(threads=1, timeout_s=2.0).map([lambda: time.sleep(0.8) or "ok"] * 3)
    assert [o.value for o in out] == ["ok"] * 3


@pytest.mark.parametrize("kwargs, key", [(dict(threads=0), "threads"), (dict(timeout_s=0), "timeout_s")])
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        EnvRunner(**kwargs)
