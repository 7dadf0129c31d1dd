"""Held-out evaluation when some rewards fail (issue 31, finding 4).

A held-out completion whose scoring failed used to carry exact_match=None, and then the whole
evaluation had no eval/exact_match, so run.stop_at_exact_match silently stopped working. A failed
score now counts as not matching and the failures are reported as eval/reward_errors.
"""
import numpy as np

from cadence.actors.engine import GenerationResult
from cadence.actors.evaluation import evaluate_heldout
from cadence.actors.rewards.scoring import InlineScorer, score_groups
from cadence.actors.tasks.base import Score
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task


class AnswerEngine:
    """Answers every prompt with its reference (the engine is not under test; scoring is)."""

    def __init__(self, task):
        self.task = task

    def generate(self, params, prompts, key, greedy=False):
        answers = {tuple(p.tokens): list(p.answer) for p in self.task.heldout()}
        rows = [answers[tuple(p)] for p in prompts]
        m = max(len(r) for r in rows)
        tokens = np.zeros((len(rows), m), np.int32)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
        lengths = np.array([len(r) for r in rows], np.int32)
        return GenerationResult(tokens, np.zeros(tokens.shape, np.float32), lengths, 0.0, int(lengths.sum()))


class FailsOnFirst:
    """The sort task whose reward raises for the first held-out prompt."""

    def __init__(self, task):
        self.task = task
        self.bad = task.heldout()[0].prompt_id

    def __getattr__(self, name):
        return getattr(self.task, name)

    def score(self, prompt, completion):
        if prompt.prompt_id == self.bad:
            raise RuntimeError("reward server exploded")
        return self.task.score(prompt, completion)


def test_a_failed_reward_counts_as_a_miss_and_is_reported():
    task = FailsOnFirst(make_task(TaskConfig(heldout_size=8)))
    metrics = evaluate_heldout(AnswerEngine(task), task, params=None, scorer=InlineScorer(task))
    assert metrics["eval/exact_match"] == 7 / 8  # the 7 that scored match; the failed one does not
    assert metrics["eval/reward_errors"] == 1


def test_no_failures_report_zero_errors():
    task = make_task(TaskConfig(heldout_size=4))
    metrics = evaluate_heldout(AnswerEngine(task), task, params=None)
    assert metrics["eval/exact_match"] == 1.0 and metrics["eval/reward_errors"] == 0


def test_training_groups_keep_exact_match_when_one_reward_fails():
    task = FailsOnFirst(make_task(TaskConfig(heldout_size=4)))
    prompts = task.heldout()[:2]
    scores = score_groups(InlineScorer(task), task, prompts, [[list(p.answer)] * 2 for p in prompts])
    assert [[s.exact_match for s in g] for g in scores] == [[False, False], [True, True]]
    assert [s.error for s in scores[0]] == ["error", "error"]


def test_a_task_without_answers_keeps_none():
    from cadence.actors.rewards.scoring import failures_as_misses
    scores = [Score(0.0, None, {}, "timeout"), Score(1.0)]
    assert [s.exact_match for s in failures_as_misses(scores)] == [None, None]
