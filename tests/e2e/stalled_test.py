"""A real training run whose learner hangs: its process lives and its heartbeat stays fresh, but
`cadence status` says stalled (exit 7) once no update has landed for run.stall_factor times the
recent update time; it reads running again when training resumes, and finished at the end."""
import json
import os
import subprocess
import sys
import threading

import pytest

from cadence.launch.run.train import train
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
HANG_AT = 25  # updates before the hang: the first, compiling update is out of the recent window


class HangingLearner:
    """Wraps a train step: update number HANG_AT waits until `release` is set."""

    def __init__(self, inner, release):
        self.inner, self.release, self.updates = inner, release, 0

    def update(self, state, microbatches, num_tokens, **kw):
        self.updates += 1
        if self.updates == HANG_AT:
            self.release.wait()
        return self.inner.update(state, microbatches, num_tokens, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def status(run):
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "status", run, "--json"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=120)
    return json.loads(out.stdout), out.returncode


def test_a_hung_learner_reads_stalled(small_config, tmp_path):
    run = str(tmp_path / "run")
    cfg = small_config(f"run.steps={HANG_AT + 5}", "run.eval_every=0", "run.heartbeat_seconds=0.5",
                       "run.stall_factor=3")
    release, errors = threading.Event(), []

    def go():
        try:
            train(cfg, run, wrap_train_step=lambda ts: HangingLearner(ts, release))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    try:
        def stalled():
            if not os.path.exists(os.path.join(run, "config.yaml")):
                return None
            got = status(run)
            return got if got[0]["state"] == "stalled" else None

        st, code = wait_for(stalled, timeout=300, what="status stalled", interval=1.0)
        assert code == 7 and st["step"] == HANG_AT - 1 and "run.stall_factor=3" in st["why"], st
        assert st["heartbeat_age"] < 10  # the heartbeat itself is fresh: only the records stopped
    finally:
        release.set()
    t.join(timeout=300)
    assert not errors and not t.is_alive()
    st, code = status(run)
    assert (st["state"], code) == ("finished", 4)
