"""Reward workers get what scoring needs, not the dataset (issue 31, finding 8).

Each worker used to call the task factory, so a JSONL task read and tokenized every record once per
worker (a 1 GB dataset under a 2 GB address limit: workers could not start). Now a task with
``scoring()`` hands workers its reward function alone; the record travels in Prompt.metadata. The
proof: the dataset file is removed after the actor's task has read it, and real spawned workers
still score.
"""
import json
import os

from cadence.actors.rewards import make_scorer
from cadence.actors.rewards.pool import RewardPool
from cadence.actors.tasks.base import Completion
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.learner.models.char_tokenizer import CharTokenizer
from cadence.learner.models.hf_random import write_tiny_tokenizer
from cadence.learner.models.hf_tokenizer import HFTokenizer

RECORDS_TASK = '''
from cadence.actors.tasks.records import RecordsTask


def reward(prompt, completion):
    return 1.0 if completion.text.strip() == prompt.metadata["answer"] else 0.0


def make(cfg, tokenizer):
    return RecordsTask(cfg, tokenizer, reward, name="qa")
'''


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _score_after_removing(cfg, task, tok, path, texts):
    """Scores the first held-out prompt's completions in a real pool started for `task`, after
    the dataset file is gone."""
    scorer = make_scorer(cfg, task, tok)
    assert isinstance(scorer, RewardPool)
    os.remove(path)  # the workers start after this (or are still starting): they must not need it
    try:
        prompt = task.heldout()[0]
        return scorer.score_groups([[(prompt, Completion((), t)) for t in texts]])[0]
    finally:
        scorer.close()


def test_jsonl_workers_score_without_the_dataset(tmp_path):
    write_tiny_tokenizer(str(tmp_path / "tok"))
    tok = HFTokenizer(str(tmp_path / "tok"))
    path = tmp_path / "math.jsonl"
    _write(path, [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(1, 9)])
    cfg = TaskConfig(name="jsonl", path=str(path), heldout_size=2, reward_workers=1, reward_memory_mb=0)
    task = make_task(cfg, tok)
    answer = task.heldout()[0].metadata["answer"].split("####")[-1].strip()
    scores = _score_after_removing(cfg, task, tok, path, [f"so \\boxed{{{answer}}}", "\\boxed{0}"])
    assert [(s.reward, s.exact_match, s.error) for s in scores] == [(1.0, True, ""), (0.0, False, "")]


def test_a_records_plugin_from_a_file_scores_without_the_dataset(tmp_path):
    task_file = tmp_path / "qa_task.py"
    task_file.write_text(RECORDS_TASK)
    path = tmp_path / "qa.jsonl"
    _write(path, [{"prompt": f"q{i}", "answer": f"a{i}"} for i in range(6)])
    cfg = TaskConfig(name=f"{task_file}:make", args={"path": str(path)}, heldout_size=2, reward_workers=1,
                     reward_memory_mb=0)
    task = make_task(cfg, CharTokenizer())
    prompt = task.heldout()[0]
    answer = prompt.metadata["answer"]
    scores = _score_after_removing(cfg, task, CharTokenizer(), path, [answer, "nope"])
    assert [(s.reward, s.error) for s in scores] == [(1.0, ""), (0.0, "")]
