"""JSONL math task: verifier table, deterministic streams, text scoring, and digit tasks on a real tokenizer."""

import json
import os
import threading

import pytest

from cadence.actors.tasks import math_verifier
from cadence.actors.tasks.registry import make_task
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.jsonl_task import JsonlMathTask
from cadence.learner.models.hf_random import write_tiny_tokenizer
from cadence.learner.models.hf_tokenizer import HFTokenizer

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "actors", "tasks", "data", "math_sample.jsonl")

# (reference answer field, model completion, equivalent?)
TABLE = [
    ("1/2", "0.5", True),
    ("0.5", "The answer is \\boxed{\\frac{1}{2}}", True),
    ("\\frac{3}{4}", "so we get 3/4", True),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "She sold 48 + 24 = 72 clips. #### 72", True),
    ("#### 1,000", "1000", True),
    ("We add: $\\boxed{\\dfrac{1}{2}}$.", "$0.50$", True),
    ("x^2+2x+1", "$(x+1)^2$", True),
    ("#### 72", "I think it is 70", False),
    ("1/2", "\\boxed{0.25}", False),
    ("-2", "\\boxed{2}", False),
    ("3", "3 apples, then 4 more", False),  # the final answer is the last one
    ("5", "", False),
    ("5", "__import__('os').system('touch /tmp/x')", False),  # parsed as text, never run
]


@pytest.mark.parametrize("reference, completion, equivalent", TABLE)
def test_verifier_table(reference, completion, equivalent):
    assert math_verifier.is_equivalent(reference, completion) is equivalent


def test_verifier_works_off_the_main_thread():
    results = []
    t = threading.Thread(target=lambda: results.append(math_verifier.is_equivalent("1/2", "0.5")))
    t.start()
    t.join()
    assert results == [True]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(str(d))
    return HFTokenizer(str(d))


def _cfg(**kw):
    return TaskConfig(**{"name": "jsonl", "path": SAMPLE, "heldout_size": 3, **kw})


def test_stream_is_deterministic_and_disjoint_from_heldout(tok):
    task = make_task(_cfg(), tok)
    again = make_task(_cfg(), tok)
    n_records = sum(1 for line in open(SAMPLE) if line.strip())
    train = [task.prompt(i) for i in range(2 * (n_records - 3))]
    assert train == [again.prompt(i) for i in range(len(train))]
    held = {task.record_id(p) for p in task.heldout()}
    assert len(held) == 3
    first_epoch = [task.record_id(p) for p in train[: n_records - 3]]
    assert sorted(first_epoch) == sorted(set(range(n_records)) - held)  # each training record once per epoch
    assert first_epoch != [task.record_id(p) for p in train[n_records - 3:]]  # reshuffled next epoch
    assert make_task(_cfg(seed=1), tok).prompt(0) != task.prompt(0) or \
        make_task(_cfg(seed=1), tok).prompt(1) != task.prompt(1)
    assert max(len(p.tokens) for p in train) <= task.max_prompt_len


def test_reward_scores_decoded_completion_by_equivalence(tok):
    task = make_task(_cfg(heldout_size=1), tok)
    records = [json.loads(line) for line in open(SAMPLE)]
    idx = next(i for i, r in enumerate(records) if r["answer"].endswith("#### 0.5"))
    prompt = next(p for p in (task.prompt(i) for i in range(20)) if task.record_id(p) == idx)
    good = tok.encode("Each pen costs \\boxed{1/2} dollars") + [tok.eos_id] + tok.encode("9")
    assert task.reward(prompt, good) == 1.0 and task.exact_match(prompt, good)
    assert task.reward(prompt, tok.encode("It costs 0.25")) == 0.0
    assert task.reward(prompt, list(prompt.answer)) == 1.0  # the reference itself (with EOS) scores 1
    assert prompt.answer[-1] == tok.eos_id


def test_chat_format_uses_the_template(tok):
    task = make_task(_cfg(format="chat", system_prompt="Answer in \\boxed{}.",
                          prompt_template="{prompt} Think step by step."), tok)
    text = tok.decode(task.prompt(0).tokens)
    assert text.startswith("<|im_start|>system\nAnswer in \\boxed{}.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith(" Think step by step.<|im_end|>\n<|im_start|>assistant\n")


def test_bad_configs_and_files_give_clear_errors(tok, tmp_path):
    with pytest.raises(ValueError, match="^heldout_size: 12 leaves no training records of the 12"):
        make_task(_cfg(heldout_size=12), tok)
    with pytest.raises(ValueError, match="^path: "):
        TaskConfig(name="jsonl").validate()
    with pytest.raises(ValueError, match="^prompt_template: "):
        _cfg(prompt_template="no slot").validate()
    with pytest.raises(ValueError, match="needs the checkpoint's tokenizer"):
        JsonlMathTask(_cfg(), None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1", "answer": "2"}\n{"question": "no answer"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: record has no field 'answer'"):
        make_task(_cfg(path=str(bad), heldout_size=1), tok)


@pytest.mark.parametrize("name, digits", [("sort", 6), ("add_reversed", 3)])
def test_digit_tasks_score_from_ids_with_a_checkpoint_tokenizer(tok, name, digits):
    task = make_task(TaskConfig(name=name, num_digits=digits, heldout_size=16), tok)
    prompts = [task.prompt(i) for i in range(50)] + task.heldout()
    assert {len(p.tokens) for p in prompts} == {task.max_prompt_len}  # no BOS: tokenizer has none
    assert {len(p.answer) for p in prompts} == {task.max_completion_len}
    p = prompts[0]
    assert task.reward(p, list(p.answer)) == 1.0 and task.exact_match(p, list(p.answer))
    wrong = list(p.answer)
    wrong[0] = tok.encode("9" if tok.decode(wrong[:1]) != "9" else "8")[0]
    assert task.reward(p, wrong) == pytest.approx(1 - 1 / len(p.answer))  # partial credit, slot by slot
    assert not task.exact_match(p, wrong)
    assert tok.decode(p.answer[:-1]).isdigit()
