"""The reward worker pool against hostile and broken rewards (real spawned processes).

The task lives in a file outside the repository (task.name=FILE.py:make), so the workers load it
the way a user's plug-in is loaded. Its reward misbehaves according to the completion's text.
"""
import os
import time

import pytest

from cadence.actors.rewards.pool import RewardPool, RewardWorkerError
from cadence.actors.rewards.scoring import InlineScorer
from cadence.actors.tasks.base import Completion, Prompt
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task, task_factory
from cadence.learner.models.char_tokenizer import CharTokenizer

HOSTILE_TASK = '''
import math, os, signal, sys, time

class Hostile:
    name = "hostile"
    max_prompt_len = 2
    max_completion_len = 4

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def prompt(self, index):
        return None

    def heldout(self):
        return []

    def score(self, prompt, completion):
        what = completion.text
        if what == "sleep":
            time.sleep(3600)
        if what == "raise":
            raise RuntimeError("reward bug")
        if what == "alloc":
            hog = []
            while True:
                hog.append(bytearray(16 * 1024 * 1024))
        if what == "exit":
            os._exit(3)
        if what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "nan":
            return math.nan
        if what == "str":
            return "1.0"
        if what == "jax":
            return 1.0 if "jax" in sys.modules else 0.5
        return 1.0

def make(cfg, tokenizer):
    if cfg.args.get("fail"):
        raise ValueError("args.fail: this task refuses to build")
    return Hostile(tokenizer)
'''


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "hostile_task.py"
    path.write_text(HOSTILE_TASK)
    return str(path)


def items(*texts):
    p = Prompt("hostile/train/0", 0, (1,))
    return [(p, Completion((4,), t)) for t in texts]


def test_hostile_rewards_score_zero_with_their_reason_and_the_rest_still_counts(task_file):
    cfg = TaskConfig(name=f"{task_file}:make")
    pool = RewardPool(task_factory(cfg, CharTokenizer()), workers=2, timeout_s=5.0, memory_mb=320)
    try:
        groups = [items("ok", "sleep", "ok", "raise"), items("alloc", "ok", "exit"),
                  items("kill", "nan", "str", "ok"), items("jax")]
        scores = pool.score_groups(groups)
        got = [[(s.reward, s.error) for s in g] for g in scores]
        assert got[0] == [(1.0, ""), (0.0, "timeout"), (1.0, ""), (0.0, "error")]
        assert got[1] == [(0.0, "memory"), (1.0, ""), (0.0, "crashed")]
        assert got[2] == [(0.0, "crashed"), (0.0, "invalid"), (0.0, "invalid"), (1.0, "")]
        # spawned, never forked from this (JAX-importing) test process: the worker has no JAX
        assert got[3] == [(0.5, "")]
        assert pool.respawns == 3  # the sleeper, the os._exit and the SIGKILL cost their workers
        # the pool keeps working after all that
        assert [s.reward for s in pool.score_groups([items("ok", "ok")])[0]] == [1.0, 1.0]
        processes = [w.process for w in pool._all]
    finally:
        pool.close()
    assert len(processes) == 2 and not any(p.is_alive() for p in processes)


def test_inline_scorer_counts_the_same_failures_that_do_not_need_a_process(task_file):
    task = make_task(TaskConfig(name=f"{task_file}:make"), CharTokenizer())
    scores = InlineScorer(task).score_groups([items("raise", "nan", "str", "ok")])[0]
    assert [(s.reward, s.error) for s in scores] == [(0.0, "error"), (0.0, "invalid"), (0.0, "invalid"),
                                                      (1.0, "")]


def test_a_task_that_does_not_build_in_a_worker_fails_loudly(task_file):
    cfg = TaskConfig(name=f"{task_file}:make", args={"fail": True})
    pool = RewardPool(task_factory(cfg, CharTokenizer()), workers=1, timeout_s=5.0, memory_mb=320)
    try:
        with pytest.raises(RewardWorkerError, match="args.fail: this task refuses to build"):
            pool.score_groups([items("ok")])
    finally:
        pool.close()


def test_close_stops_every_worker(task_file):
    pool = RewardPool(task_factory(TaskConfig(name=f"{task_file}:make"), CharTokenizer()), workers=2,
                      timeout_s=5.0, memory_mb=512)
    pool.wait_ready()
    deadline = time.monotonic() + 60
    while len(pool._all) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [w.process.pid for w in pool._all]
    pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
