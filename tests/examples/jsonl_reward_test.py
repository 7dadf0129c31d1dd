"""examples/jsonl_reward: the task builds from the example's files and its reward reads the text."""
import os

from cadence.actors.rewards.scoring import make_completion
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.launch.config import load_config
from cadence.learner.models.char_tokenizer import CharTokenizer

HERE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "jsonl_reward")


def test_reward_scores_format_and_correctness():
    cfg = load_config([os.path.join(HERE, "config.yaml")])  # the example's own config validates
    tok = CharTokenizer()
    task = make_task(cfg.task, tok)
    p = task.prompt(0)
    answer = p.metadata["answer"]
    assert p.answer == (*tok.encode(answer), tok.eos_id) and p.text == p.metadata["question"]
    right = task.score(p, make_completion(tok, [*tok.encode(answer), tok.eos_id]))
    assert right.reward == 1.0 and right.exact_match is True
    no_eos = task.score(p, make_completion(tok, tok.encode(answer)))
    assert no_eos.reward == 0.8 and no_eos.exact_match is False
    junk = task.score(p, make_completion(tok, [*tok.encode("ab"), tok.eos_id]))
    assert junk.reward == 0.0 and junk.metrics == {"well_formed": 0.0}


def test_records_task_errors_name_the_argument(tmp_path):
    import pytest
    with pytest.raises(ValueError, match="^args.path: "):
        make_task(TaskConfig(name=os.path.join(HERE, "additions_task.py") + ":make", args={}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1="}\n{oops\n')
    with pytest.raises(ValueError, match=r"^args.path: .*bad.jsonl:2: invalid JSON"):
        make_task(TaskConfig(name=os.path.join(HERE, "additions_task.py") + ":make",
                             args={"path": str(bad), "prompt_field": "question"}))
