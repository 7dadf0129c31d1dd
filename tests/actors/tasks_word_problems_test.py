"""Word problems task: seeded streams, a held-out set disjoint from training, answers recomputed from
each problem's structure, the op-count mix, scoring through the math verifier, and the chat prompt."""

import collections
import random
import re

import pytest

from cadence.actors.tasks.base import Completion
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.actors.tasks.word_problem_gen import generate
from cadence.actors.tasks.word_problems import HELDOUT_SPLIT, TRAIN_SPLIT, WordProblemsTask
from cadence.launch.config import load_config
from cadence.launch.config_loader import ConfigError
from cadence.learner.models.hf_random import write_tiny_tokenizer
from cadence.learner.models.hf_tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(str(d))  # byte-level BPE with a ChatML template
    return HFTokenizer(str(d))


def _cfg(**kw):
    return TaskConfig(**{"name": "word_problems", "heldout_size": 64, "format": "chat", **kw})


@pytest.fixture(scope="module")
def task(tok):
    return make_task(_cfg(), tok)


def _value(tree):
    """Plain recomputation of a problem's arithmetic from its structure (metadata["tree"])."""
    if isinstance(tree, int):
        return tree
    op, a, b = tree[0], _value(tree[1]), _value(tree[2])
    if op == "/":
        assert b != 0 and a % b == 0, f"inexact division {a} / {b}"
        return a // b
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _leaves(tree):
    return [tree] if isinstance(tree, int) else _leaves(tree[1]) + _leaves(tree[2])


def _ops(tree):
    return 0 if isinstance(tree, int) else 1 + _ops(tree[1]) + _ops(tree[2])


def test_streams_are_pure_functions_of_their_seeds(tok, task):
    again = make_task(_cfg(), tok)
    assert [task.prompt(i) for i in range(200)] == [again.prompt(i) for i in range(200)]
    assert task.heldout() == again.heldout()
    other = make_task(_cfg(seed=1), tok)
    assert sum(task.prompt(i).text != other.prompt(i).text for i in range(50)) > 45
    assert other.heldout() == task.heldout()  # the held-out set does not follow the training seed
    moved = make_task(_cfg(heldout_seed=7), tok)
    assert {p.text for p in moved.heldout()} != {p.text for p in task.heldout()}
    bigger = make_task(_cfg(heldout_size=80), tok)
    assert bigger.heldout()[:64] == task.heldout()  # a larger held-out set extends a smaller one
    p = task.prompt(17)
    assert p.prompt_id == "word_problems/train/17" and p.index == 17
    assert task.heldout()[3].prompt_id == "word_problems/heldout/3"


def test_heldout_never_appears_in_the_training_stream(task):
    held = {p.text for p in task.heldout()}
    assert len(held) == 64  # distinct problems
    train = [task.prompt(i) for i in range(3000)]
    assert not held & {p.text for p in train}
    assert not any(task.is_heldout(p) for p in train)
    assert all(task.is_heldout(p) for p in task.heldout())


def test_a_training_draw_of_a_heldout_problem_is_drawn_again(tok, monkeypatch):
    task = make_task(_cfg(heldout_size=4), tok)
    clash = task.problem(HELDOUT_SPLIT, task.config.heldout_seed, 0)
    assert clash.text == task.heldout()[0].text
    real = task.problem

    def problem(split, seed, index, attempt=0):
        if split == TRAIN_SPLIT and index == 5 and attempt == 0:
            return clash
        return real(split, seed, index, attempt)

    monkeypatch.setattr(task, "problem", problem)
    p = task.prompt(5)
    assert p.text != clash.text and p.text == real(TRAIN_SPLIT, 0, 5, 1).text


def test_every_problem_states_its_operands_and_its_answer_is_right(tok, task):
    prompts = [task.prompt(i) for i in range(1500)] + task.heldout()
    for p in prompts:
        tree, answer = p.metadata["tree"], p.metadata["answer"]
        assert _value(tree) == answer, p.text
        assert 0 <= answer <= 1000 and isinstance(answer, int)
        assert _ops(tree) == p.metadata["ops"] in (1, 2, 3)
        numbers = collections.Counter(int(n) for n in re.findall(r"\d+", p.text))
        for leaf in _leaves(tree):
            assert numbers[leaf] > 0, f"{leaf} is not in {p.text!r}"
        assert p.text.endswith("?")
        assert tok.decode(p.answer, skip_special_tokens=True).endswith(f"\\boxed{{{answer}}}.")
        assert p.answer[-1] == tok.eos_id
        assert len(p.tokens) <= task.max_prompt_len and len(p.answer) <= task.max_completion_len


def test_the_generator_recomputes_what_it_states():
    rng = random.Random(3)
    for i in range(3000):
        problem = generate(rng, 1 + i % 3)
        assert _value(problem.tree) == problem.answer and problem.ops == 1 + i % 3
    with pytest.raises(ValueError, match="num_ops"):
        generate(rng, 4)


def test_op_counts_are_mixed_evenly_up_to_max_ops(tok, task):
    prompts = [task.prompt(i) for i in range(1500)]
    ops = collections.Counter(p.metadata["ops"] for p in prompts)
    assert set(ops) == {1, 2, 3}
    assert all(0.28 < ops[k] / len(prompts) < 0.39 for k in ops), ops
    ops_of = collections.Counter((p.metadata["ops"], str(p.metadata["tree"][0])) for p in prompts)
    assert {op for (_, op) in ops_of} == {"+", "-", "*", "/"}  # every operation is the last step somewhere
    families = collections.Counter(p.metadata["family"] for p in prompts)
    assert set(families) == {"collection", "shop", "rate", "groups"} and min(families.values()) > 250
    easy = make_task(_cfg(max_ops=1, heldout_size=8), tok)
    assert {easy.prompt(i).metadata["ops"] for i in range(200)} == {1}


def test_scoring_accepts_the_right_final_answer_only(tok, task):
    p = next(task.prompt(i) for i in range(100) if task.prompt(i).metadata["answer"] > 10)
    n = p.metadata["answer"]

    def score(text):
        return task.score(p, Completion(tuple(tok.encode(text)), text))

    good = score(f"First we add things up.\nSo the answer is \\boxed{{{n}}}.")
    assert (good.reward, good.exact_match, good.metrics["formatted"]) == (1.0, True, 1.0)
    assert score(f"The total is {n} + 1 = {n + 1}.\n#### {n + 1}").reward == 0.0
    assert score(f"Work: 2 + 2 = 4.\n#### {n}").reward == 1.0
    assert score(f"It could be {n}, but \\boxed{{{n - 1}}}").reward == 0.0  # the boxed answer wins
    unformatted = score(f"The answer is {n}.")  # the verifier's fallback: the stated answer
    assert (unformatted.reward, unformatted.metrics["formatted"]) == (1.0, 0.0)
    assert score("I am not sure how to solve this.").reward == 0.0
    assert score("").reward == 0.0
    assert task.reward(p, list(p.answer)) == 1.0  # the worked solution scores 1
    wrong_after_eos = list(p.answer) + tok.encode(f"\\boxed{{{n + 3}}}")
    assert task.reward(p, wrong_after_eos) == 1.0 and task.exact_match(p, wrong_after_eos)


def test_the_prompt_goes_through_the_chat_template(tok, task):
    p = task.prompt(0)
    text = tok.decode(p.tokens)
    assert "<|im_start|>user\n" + p.text + "\nPlease reason step by step" in text
    assert text.endswith("within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    custom = make_task(_cfg(system_prompt="Be brief.", prompt_template="Q: {prompt}\nA in \\boxed{}."), tok)
    text = tok.decode(custom.prompt(0).tokens)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: " + p.text)
    assert text.endswith("A in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    plain = make_task(_cfg(format="plain", heldout_size=4), tok)
    assert tok.decode(plain.prompt(0).tokens) == p.text + "\nPlease reason step by step, and put your " \
        "final answer within \\boxed{}."


def test_bad_settings_name_their_key(tok, tmp_path):
    for bad in (0, 4):
        with pytest.raises(ValueError, match="^max_ops: "):
            make_task(_cfg(max_ops=bad), tok)
    with pytest.raises(ValueError, match="^prompt_template: "):
        make_task(_cfg(prompt_template="no slot"), tok)
    with pytest.raises(ValueError, match="needs the checkpoint's tokenizer"):
        WordProblemsTask(_cfg(), None)
    with pytest.raises(ConfigError, match="word_problems task needs a checkpoint tokenizer"):
        load_config([], ["task.name=word_problems"])
