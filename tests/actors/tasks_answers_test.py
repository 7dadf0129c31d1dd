"""Answers of the built-in tasks, checked against Python's sorted() and int arithmetic."""

import pytest

from cadence.actors.tasks import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.learner.models.char_tokenizer import CharTokenizer

TOK = CharTokenizer()
DIGIT_OF = {TOK.digit_id(d): str(d) for d in range(10)}
PLUS, EQUALS, ARROW = (TOK.encode(c)[0] for c in "+=>")


def digits(ids):
    """Digit string of ids, independently of CharTokenizer.decode; fails on a non-digit."""
    return "".join(DIGIT_OF[i] for i in ids)


def test_sort_renders_hand_made_cases():
    task = make_task(TaskConfig(name="sort", num_digits=6, heldout_size=8))
    assert task._render(583920) == ("583920>", "023589")
    assert task._render(7) == ("000007>", "000007")  # leading zeros are digits too
    assert task._render(999999) == ("999999>", "999999")


def test_add_reversed_renders_hand_made_cases():
    task = make_task(TaskConfig(name="add_reversed", num_digits=3, heldout_size=8))
    assert task._render(123_456) == ("321+654=", "9750")  # 123 + 456 = 0579
    assert task._render(999_999) == ("999+999=", "8991")  # 1998: the carry fills the last digit
    assert task._render(0) == ("000+000=", "0000")
    assert task._render(5_007) == ("500+700=", "2100")  # 5 + 7 = 0012


@pytest.mark.parametrize("num_digits", [1, 4, 6, 12])
def test_sort_answers_match_sorted(num_digits):
    task = make_task(TaskConfig(name="sort", num_digits=num_digits, heldout_size=4))
    assert task.max_prompt_len == num_digits + 2 and task.max_completion_len == num_digits + 1
    for p in [task.prompt(i) for i in range(500)] + task.heldout():
        assert p.tokens[0] == TOK.bos_id and p.tokens[-1] == ARROW
        problem = digits(p.tokens[1:-1])
        assert len(problem) == num_digits
        assert p.answer[-1] == TOK.eos_id
        assert digits(p.answer[:-1]) == "".join(sorted(problem))


@pytest.mark.parametrize("num_digits", [1, 3, 7, 12])
def test_add_reversed_answers_match_int_arithmetic(num_digits):
    task = make_task(TaskConfig(name="add_reversed", num_digits=num_digits, heldout_size=4))
    n = num_digits
    assert task.max_prompt_len == 2 * n + 3 and task.max_completion_len == n + 2
    for p in [task.prompt(i) for i in range(500)] + task.heldout():
        body = p.tokens[1:]
        assert p.tokens[0] == TOK.bos_id
        assert body[n] == PLUS and body[-1] == EQUALS and len(body) == 2 * n + 2
        a = int(digits(body[:n])[::-1])
        b = int(digits(body[n + 1 : -1])[::-1])
        assert p.answer[-1] == TOK.eos_id
        total = digits(p.answer[:-1])
        assert len(total) == n + 1
        assert int(total[::-1]) == a + b


def test_add_reversed_operands_cover_the_range():
    # Uniform operands: leading (reversed: trailing) zeros and carries into the last digit occur.
    task = make_task(TaskConfig(name="add_reversed", num_digits=2, heldout_size=4))
    carries = sum(digits(task.prompt(i).answer[:-1])[-1] == "1" for i in range(2000))
    assert 0.3 < carries / 2000 < 0.7  # P(a + b >= 100) = 0.495 for a, b uniform in [0, 100)
