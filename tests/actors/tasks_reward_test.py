"""Rewards and exact match, scored from token ids."""

import random

import numpy as np
import pytest

from cadence.actors.tasks import Prompt, TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.actors.tasks import scoring
from cadence.actors.tasks.evaluate import exact_match_rate, mean_reward
from cadence.learner.models.char_tokenizer import CharTokenizer

TOK = CharTokenizer()
EOS, PAD, UNK = TOK.eos_id, TOK.pad_id, TOK.unk_id
JUNK = 57  # a valid model output (vocab 64) that the tokenizer does not define
D = TOK.digit_id


def sort_task(reward="partial"):
    return make_task(TaskConfig(name="sort", num_digits=3, heldout_size=8, reward=reward))


# Hand-made prompt "312>" whose answer is "123" + EOS: four slots.
PROMPT = Prompt(
    prompt_id="sort3/train/0",
    index=0,
    tokens=(TOK.bos_id, D(3), D(1), D(2), TOK.encode(">")[0]),
    answer=(D(1), D(2), D(3), EOS),
)

# name, completion, partial reward, exact match
TABLE = [
    ("exact", [D(1), D(2), D(3), EOS], 1.0, True),
    ("one digit wrong", [D(1), D(2), D(4), EOS], 0.75, False),
    ("junk id instead of EOS", [D(1), D(2), D(3), JUNK], 0.75, False),
    ("unk id instead of EOS", [D(1), D(2), D(3), UNK], 0.75, False),
    ("missing EOS (truncated)", [D(1), D(2), D(3)], 0.75, False),
    ("too short", [D(1), EOS], 0.25, False),
    ("empty", [], 0.0, False),
    ("trailing tokens after EOS ignored", [D(1), D(2), D(3), EOS, D(5), JUNK], 1.0, True),
    ("padding after EOS ignored", [D(1), D(2), D(3), EOS, PAD, PAD], 1.0, True),
    ("extra digit before EOS", [D(1), D(2), D(3), D(3), EOS], 0.75, False),
    ("EOS first", [EOS, D(1), D(2), D(3)], 0.0, False),
    ("junk in a digit slot", [D(1), JUNK, D(3), EOS], 0.75, False),
    ("all wrong but EOS", [D(9), D(9), D(9), EOS], 0.25, False),
]


@pytest.mark.parametrize("name, completion, partial, exact", TABLE, ids=[r[0] for r in TABLE])
def test_partial_reward_and_exact_match_table(name, completion, partial, exact):
    task = sort_task()
    assert task.reward(PROMPT, completion) == pytest.approx(partial)
    assert task.exact_match(PROMPT, completion) is exact
    # Same answers whatever the container the engine hands back.
    assert task.reward(PROMPT, np.asarray(completion, dtype=np.int32)) == pytest.approx(partial)
    assert task.exact_match(PROMPT, tuple(completion)) is exact


@pytest.mark.parametrize("name, completion, partial, exact", TABLE, ids=[r[0] for r in TABLE])
def test_exact_reward_is_one_or_zero(name, completion, partial, exact):
    assert sort_task("exact").reward(PROMPT, completion) == (1.0 if exact else 0.0)


def test_junk_instead_of_eos_scores_strictly_below_eos_terminated():
    task = sort_task()
    digits = [D(1), D(2), D(4)]  # also with a wrong digit: EOS credit is still what differs
    for body in ([D(1), D(2), D(3)], digits):
        with_eos = task.reward(PROMPT, body + [EOS])
        with_junk = task.reward(PROMPT, body + [JUNK])
        assert with_junk < with_eos
        assert with_junk < 1.0 and not task.exact_match(PROMPT, body + [JUNK])


def partial_reference(answer, completion, eos):
    """NumPy reference: cut after the first EOS, pad with -1 to len(answer), compare slots."""
    c = np.asarray(completion, dtype=np.int64)
    stops = np.flatnonzero(c == eos)
    if stops.size:
        c = c[: stops[0] + 1]
    padded = np.full(len(answer), -1, dtype=np.int64)
    n = min(len(c), len(answer))
    padded[:n] = c[:n]
    return float(np.mean(padded == np.asarray(answer)))


@pytest.mark.parametrize("name, num_digits", [("sort", 6), ("add_reversed", 3)])
def test_partial_reward_matches_numpy_reference_on_random_completions(name, num_digits):
    task = make_task(TaskConfig(name=name, num_digits=num_digits, heldout_size=8))
    rng = random.Random(0)
    pool = [EOS, PAD, UNK, JUNK, 63] + [D(d) for d in range(10)]
    for i in range(300):
        p = task.prompt(i)
        # Start from the answer and corrupt some slots, so both high and low scores occur.
        completion = list(p.answer) + [rng.choice(pool) for _ in range(rng.randrange(3))]
        for j in range(len(completion)):
            if rng.random() < 0.3:
                completion[j] = rng.choice(pool)
        completion = completion[: rng.randrange(len(completion) + 1)]
        expected = partial_reference(p.answer, completion, EOS)
        assert task.reward(p, completion) == pytest.approx(expected)
        cut = scoring.truncate_at_eos(completion, EOS)
        assert task.exact_match(p, completion) is (cut == list(p.answer))


def test_partial_credit_rejects_empty_answer():
    with pytest.raises(ValueError):
        scoring.partial_credit((), [EOS], EOS)


def test_evaluate_helpers():
    task = sort_task()
    prompts = task.heldout()[:4]
    completions = [
        list(prompts[0].answer),  # exact: 1.0
        list(prompts[1].answer[:-1]) + [JUNK],  # 0.75
        [],  # 0.0
        list(prompts[3].answer) + [JUNK, JUNK],  # exact: 1.0
    ]
    assert exact_match_rate(task, prompts, completions) == pytest.approx(0.5)
    assert mean_reward(task, prompts, completions) == pytest.approx((1 + 0.75 + 0 + 1) / 4)
    assert mean_reward(sort_task("exact"), prompts, completions) == pytest.approx(0.5)


def test_evaluate_helpers_reject_bad_inputs():
    task = sort_task()
    prompts = task.heldout()[:2]
    for fn in (exact_match_rate, mean_reward):
        with pytest.raises(ValueError):
            fn(task, prompts, [[EOS]])
        with pytest.raises(ValueError):
            fn(task, [], [])
