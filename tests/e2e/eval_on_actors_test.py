"""Held-out evaluation as work for an actor process (run.eval_on=actors), through the real CLI: the
process evaluates at step 0, every run.eval_every steps and at the end, and its numbers for the
final weights are exactly what the learner's own engine gives for them (greedy decoding)."""
import json
import os
import subprocess
import sys

import pytest

import cadence
from cadence.launch.evaluate import evaluate
from cadence.launch.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_an_actor_process_evaluates_and_its_numbers_equal_the_learner_s(tmp_path):
    run = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={run}", "run.steps=6",
                          "run.eval_every=3", "run.eval_on=actors", "actors.processes=1", "learner.sft.steps=30",
                          "task.heldout_size=32", "run.progress=false"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    evals = [m for m in read_metrics(run) if "eval/reward" in m]
    assert [m["step"] for m in evals] == [0, 3, 6]
    # eval/generate_seconds: the actor process's engine time, which only its evaluation reports
    assert all(m["eval/generate_seconds"] > 0 and m["eval/seconds"] >= m["eval/generate_seconds"] for m in evals)
    # the final weights, evaluated by the learner's built-in engine in this process
    mine = evaluate(cadence.load_config([os.path.join(run, "config.yaml")]), run).metrics
    theirs = summary["final_eval"]
    assert {k: theirs[k] for k in mine} == mine, (theirs, mine)
    assert set(theirs) - set(mine) == {"eval/seconds", "eval/generate_seconds"}
    assert 0 < mine["eval/reward"] < 1


SHIFTED = '''
import dataclasses, sys
from cadence.actors.tasks.registry import make_task


class Shifted:
    """The sort task, except that in an actor process its held-out set starts one prompt later:
    the actor's held-out prompts are not the learner's (as with another task config or data)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def heldout(self):
        prompts = self._inner.heldout()
        return prompts[1:] if "actor" in sys.argv else prompts


def make(cfg, tokenizer):
    return Shifted(make_task(dataclasses.replace(cfg, name="sort"), tokenizer))
'''


def test_an_evaluation_that_fails_on_every_actor_ends_the_run_naming_the_actor_s_error(tmp_path):
    (tmp_path / "shifted_task.py").write_text(SHIFTED)
    run = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={run}", "run.steps=3",
                          "task.name=shifted_task:make", "run.eval_on=actors", "actors.processes=1",
                          "actors.restart_backoff_seconds=0.1", "learner.sft.steps=0", "task.heldout_size=8",
                          "run.progress=false"],
                         capture_output=True, text=True, env=env, timeout=300)  # retried forever: would time out
    assert out.returncode != 0
    assert "held-out evaluation on the actors: 3 actors failed evaluating version 0" in out.stderr, out.stderr[-3000:]
    assert "the actor's task config or data differ from the learner's" in out.stderr


SLOW_HELDOUT = '''
import dataclasses, os, sys, time
from cadence.actors.tasks.registry import make_task


class SlowHeldout:
    """The sort task, except that the first held-out reward an actor process computes takes two
    minutes (it leaves a marker file when it starts)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def score(self, prompt, completion):
        marker = os.environ["SLOW_HELDOUT_MARKER"]
        if "/heldout/" in prompt.prompt_id and "actor" in sys.argv and not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(120)
        return self._inner.score(prompt, completion)


def make(cfg, tokenizer):
    return SlowHeldout(make_task(dataclasses.replace(cfg, name="sort"), tokenizer))
'''


def test_a_stop_signal_during_an_actor_evaluation_checkpoints_and_exits_without_waiting_for_it(tmp_path):
    import signal
    import time

    from tests.waiting import wait_for

    (tmp_path / "slow_heldout.py").write_text(SLOW_HELDOUT)
    run, marker = str(tmp_path / "run"), str(tmp_path / "marker")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]), SLOW_HELDOUT_MARKER=marker)
    args = [sys.executable, "-m", "cadence.launch.cli", "train", f"run.dir={run}", "run.steps=3",
            "task.name=slow_heldout:make", "task.reward_workers=0", "run.eval_on=actors", "actors.processes=1",
            "learner.sft.steps=0", "task.heldout_size=8"]  # progress on: its messages are read below
    learner = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for(lambda: os.path.exists(marker), proc=learner, what="the step-0 evaluation to be scoring", timeout=120)
    learner.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, err = learner.communicate(timeout=300)
    assert learner.returncode == 0, err[-3000:]
    assert time.monotonic() - t0 < 90, "the learner waited for the evaluation (two minutes) instead of stopping"
    assert "held-out evaluation of version 0: given up, the run is stopping" in err, err[-3000:]
    records = read_metrics(run)
    assert [r["step"] for r in records] == [0] and "eval/reward" not in records[0]
    # the checkpoint it left resumes: the rest of the run, evaluated by the actor at the end
    out = subprocess.run([*args[:4], "--resume", f"run.dir={run}"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and "eval/generate_seconds" in summary["final_eval"], summary
