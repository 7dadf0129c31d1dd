"""Hostile completions against the math verifier and the JSONL task (issue 22, findings 5 and 12).

Finding 5: `so the result is 9**9**9**9` made math_verify.verify run for minutes against "1",
hanging the actor. Each case runs in a child process with a deadline, so a regression fails the
test instead of hanging it. Finding 12: the verifier ran twice per completion (reward, then exact
match); the actor now scores once.
"""
import json
import os
import subprocess
import sys

import pytest

from cadence.actors.actor_loop import Actor
from cadence.actors.prompt_stream import PromptStream
from cadence.actors.rewards.pool import RewardPool
from cadence.actors.tasks import math_verifier
from cadence.actors.tasks.base import Completion
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task, task_factory
from cadence.learner.models.hf_random import write_tiny_tokenizer
from cadence.learner.models.hf_tokenizer import HFTokenizer
from cadence.protocols.weights import InProcessWeights
from tests.scripted_engine import ScriptedEngine

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "actors", "tasks", "data", "math_sample.jsonl")

HOSTILE = [
    "so the result is 9**9**9**9",  # the reproducer: a power tower
    "\\boxed{9^{9^{9^9}}}",  # the same in LaTeX
    "x = 10**100000000",  # one huge power
    "\\boxed{(10^{10})!}",  # a huge factorial
    "\\boxed{100000!}",
    "the answer is (lambda: __import__('os').system('touch {sentinel}'))()",
    "__import__('os').system('touch {sentinel}')",
]


@pytest.mark.parametrize("completion", HOSTILE)
def test_hostile_completion_is_refused_quickly_and_runs_no_code(completion, tmp_path):
    sentinel = tmp_path / "pwned"
    text = completion.replace("{sentinel}", str(sentinel))
    code = ("import json, sys; from cadence.actors.tasks import math_verifier as m; "
            "print(json.dumps(m.is_equivalent('1', sys.argv[1])))")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        out = subprocess.run([sys.executable, "-c", code, text], capture_output=True, text=True,
                             timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the verifier did not return within 60 s on {text!r}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False
    assert not sentinel.exists()


def test_tame_answers_still_verify():
    assert math_verifier.is_equivalent("1024", "\\boxed{2^{10}}")
    assert math_verifier.is_equivalent("120", "so 5! = 120")
    assert math_verifier.is_equivalent("x^2+2x+1", "$(x+1)^2$")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(str(d))
    return HFTokenizer(str(d))


def test_jsonl_task_scores_in_the_pool(tok):
    """Workers rebuild the task from its config and tokenizer, and score once per completion."""
    cfg = TaskConfig(name="jsonl", path=SAMPLE, heldout_size=3)
    task = make_task(cfg, tok)
    prompt = task.heldout()[0]
    pool = RewardPool(task_factory(cfg, tok), workers=1, timeout_s=5.0, memory_mb=1024)
    try:
        answer = task.reference(prompt)
        assert answer  # the worker parses the same reference
        good = Completion((), str(prompt.metadata[cfg.answer_field]).split("####")[-1].strip())
        tower = Completion((), "so the result is 9**9**9**9")
        scores = pool.score_groups([[(prompt, good), (prompt, tower)]])[0]
        assert [(s.reward, s.exact_match, s.error) for s in scores] == [(1.0, True, ""), (0.0, False, "")]
    finally:
        pool.close()


def test_actor_verifies_each_completion_once(tok, monkeypatch):
    task = make_task(TaskConfig(name="jsonl", path=SAMPLE, heldout_size=3), tok)
    calls = []
    real = math_verifier.check
    monkeypatch.setattr(math_verifier, "check", lambda *a, **k: calls.append(1) or real(*a, **k))
    stream = PromptStream(task)
    prompts = stream.take(2)
    answers = [tok.encode(str(task._records[task.record_id(p)]["answer"]).split("####")[-1].strip())
               + [tok.eos_id] for p in prompts]
    engine = ScriptedEngine([answers[0], tok.encode("7") + [tok.eos_id]])
    actor = Actor("a", engine, task, None, InProcessWeights({}, 0), group_size=2, prompts_per_call=2, seed=0)
    groups = actor.step(prompts)
    assert len(calls) == 4  # 2 prompts x G=2 completions, one verification each
    assert groups[0].rewards[0] == 1.0 and groups[0].exact_match[0] is True
    assert groups[1].exact_match[1] is False
