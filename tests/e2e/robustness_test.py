"""What a careful review of the training path found (issue: correctness and robustness), each
through a real run: the PPO reference starts from the warmed-up weights; a resume restores the batch
size, Adam's hyperparameters and the actors' concurrency the controller had moved to; a resume with a
bounded queue does not block; a crashed actor is reported with its own error, a hung one by name and
phase; a preempted run's deadline never outlives it."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cadence.actors.engine import JaxEngine
from cadence.launch.config import load_config
from cadence.launch.metrics import read_metrics
from cadence.launch.run.train import train
from cadence.learner.controller import AdamHyperparams, Decision, FixedBatchSize
from cadence.learner.loop import PipelineStopped
from tests.slow_learner import SlowLearner

FAST = ["learner.sft.steps=5", "task.heldout_size=16", "run.progress=false", "run.eval_every=0",
        "learner.batch_size=32", "learner.microbatch_size=16", "actors.prompts_per_call=2"]


def test_ppo_reference_is_the_warmed_up_policy(tmp_path):
    cfg = load_config(overrides=FAST + ["learner.algorithm=ppo", "learner.ppo.kl_coef=0.1", "learner.sft.steps=20",
                                        "run.steps=2", "actors.max_staleness=0"])
    train(cfg, str(tmp_path / "run"))
    first = read_metrics(str(tmp_path / "run"))[1]
    # At step 1 the policy is exactly the warmed-up model: its KL to the reference is zero. (With the
    # reference copied from the random init it was the whole distance the warm-up travelled.)
    assert first["step"] == 1 and abs(first["kl_ref_start"]) < 1e-6, first["kl_ref_start"]


class MovesOnce(FixedBatchSize):
    """At step 3, doubles B with the square-root rule and doubles the actors' concurrency."""

    def __init__(self):
        super().__init__(batch_size=32, concurrency=2)  # FAST's learner.batch_size, actors.prompts_per_call

    def update(self, obs):
        if obs.step == 3:
            k = 2
            self.batch_size, self.concurrency = 64, 4
            return Decision(batch_size=64, concurrency=4, reason="test: grow B",
                            hyperparams=AdamHyperparams(learning_rate=1e-3 * k ** 0.5, b1=0.9 ** k, b2=0.999 ** k,
                                                        eps=1e-8 / k ** 0.5))
        return None


def hyper(m):
    return {k: m[k] for k in ("batch_size", "learning_rate", "b1", "b2", "eps", "actors/concurrency")}


def preempt_at(run: str, step: int) -> threading.Thread:
    """SIGTERM this process once the run at `run` has logged `step` (as a scheduler would)."""
    def wait_and_signal():
        path = os.path.join(run, "metrics.jsonl")
        while not os.path.exists(path) or max([m["step"] for m in read_metrics(run)], default=-1) < step:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=wait_and_signal, daemon=True)
    t.start()
    return t


@pytest.mark.slow
def test_resume_keeps_the_batch_size_adam_and_concurrency_the_controller_chose(tmp_path):
    run = str(tmp_path / "run")
    cfg = load_config(overrides=FAST + ["run.steps=12", "checkpoint.every_steps=2", "learner.optimizer.lr=1e-3"])
    preempt_at(run, 6)
    summary = train(cfg, run, controller=MovesOnce())
    assert summary["preempted"]
    before = read_metrics(run)[-1]
    train(cfg, run, resume="yes", controller=MovesOnce())  # a fresh controller object: state from the checkpoint
    rows = read_metrics(run)
    after = next(m for m in rows if m["step"] == before["step"] + 1)
    assert before["batch_size"] == after["batch_size"] == 64
    assert hyper(before) == hyper(after) and after["actors/concurrency"] == 4
    assert after["learning_rate"] == pytest.approx(1e-3 * 2 ** 0.5)


@pytest.mark.slow
def test_resume_with_a_bounded_queue_smaller_than_the_restored_groups(tmp_path):
    run = str(tmp_path / "run")
    cfg = load_config(overrides=FAST + ["run.steps=6", "actors.max_staleness=8", "checkpoint.every_steps=1"])
    preempt_at(run, 2)
    train(cfg, run, wrap_train_step=lambda ts: SlowLearner(ts, 0.5))  # actors run far ahead: groups queue up
    newest = max(int(d) for d in os.listdir(os.path.join(run, "checkpoints")) if d.isdigit())
    with open(os.path.join(run, "checkpoints", str(newest), "meta", "metadata")) as f:
        restored = len(json.load(f)["ledger"]["queued"])
    assert restored > 2, restored
    resumed = load_config(overrides=FAST + ["run.steps=6", "actors.max_staleness=8", "actors.queue_size=2"])
    summary = train(resumed, run, resume="yes")  # used to block forever putting the groups back
    assert summary["steps"] == 6 and summary["resumed_from"][-1]["queued_restored"] == restored


def test_a_crashed_actor_is_reported_with_its_own_error(tmp_path, monkeypatch):
    real = JaxEngine.generate
    calls = {"n": 0}

    def generate(self, params, rows, key, greedy=False):
        if not greedy:  # actor calls, not the held-out evaluation
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("engine exploded")
        return real(self, params, rows, key, greedy=greedy)

    monkeypatch.setattr(JaxEngine, "generate", generate)
    cfg = load_config(overrides=FAST + ["run.steps=20"])
    with pytest.raises(PipelineStopped, match="actor-0 failed: RuntimeError: engine exploded"):
        train(cfg, str(tmp_path / "run"))


def test_a_hung_actor_is_named_with_what_it_was_doing(tmp_path, monkeypatch):
    real = JaxEngine.generate
    calls = {"n": 0}
    release = threading.Event()

    def generate(self, params, rows, key, greedy=False):
        if not greedy:
            calls["n"] += 1
            if calls["n"] == 3:
                release.wait(120)  # a generation (or a verifier) that never returns
        return real(self, params, rows, key, greedy=greedy)

    monkeypatch.setattr(JaxEngine, "generate", generate)
    cfg = load_config(overrides=FAST + ["run.steps=20", "actors.liveness_timeout_seconds=3"])
    try:
        with pytest.raises(PipelineStopped, match=r"actor actor-0 made no progress for \d+ s while generating"):
            train(cfg, str(tmp_path / "run"))
    finally:
        release.set()


def test_a_preempted_runs_deadline_is_cancelled_when_it_ends():
    """Two preempted runs in one process: the first one's deadline must not kill the second."""
    script = textwrap.dedent("""
        import os, signal, time
        from cadence.launch.run.lifecycle import Lifecycle
        for run in range(2):
            with Lifecycle(timeout=1.0) as life:
                os.kill(os.getpid(), signal.SIGTERM)
                assert life.stop.wait(5) and life.signalled == "SIGTERM"
                assert 0 < life.remaining() <= 1.0
            time.sleep(1.5)  # past the deadline: it was cancelled when the run ended
        print("both finished")
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0 and "both finished" in out.stdout, out.stderr
    assert out.stderr.count("SIGTERM: saving a final checkpoint") == 2


def test_a_run_past_its_deadline_exits_with_status_1():
    script = textwrap.dedent("""
        import os, signal, time
        from cadence.launch.run.lifecycle import Lifecycle
        with Lifecycle(timeout=0.5) as life:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # a final checkpoint that never finishes
        print("not reached")
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 1 and "final checkpoint not done within" in out.stderr, out.stderr
    assert "not reached" not in out.stdout and time.monotonic() - t0 < 9
