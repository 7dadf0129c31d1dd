"""The allow-list math verifier (issue 31, finding 3): no completion can hang or fool it.

The reproducers of the finding: `(lambda: 1)()` scored as 1; a nested power tower passed the old
size guard and ran verify for seconds; \\binom{1000000}{500000} hung in the parse; "#### 1", a long
run of spaces and "x" took quadratic time in the answer regex. Each runs in a child process with a
deadline, so a regression fails the test instead of hanging it.
"""
import json
import os
import random
import subprocess
import sys

import pytest

from cadence.actors.tasks import math_expr, math_verifier

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "actors", "tasks", "data", "math_sample.jsonl")

# (completion, the refusal it must be counted as)
REPRODUCERS = {
    "lambda": ("\\boxed{(lambda: 1)()}", "syntax"),
    "tower": ("\\boxed{((10^{999})^{999})^{999}}", "too_large"),
    "binom": ("\\boxed{\\binom{1000000}{500000}}", "too_large"),
    # 300k spaces: quadratic scanning of the uncut text would take minutes (32k took 3.3 s).
    "spaces": ("#### 1" + " " * 300_000 + "x", None),
}


def _check_in_child(reference: str, completion: str, timeout: float = 20.0) -> dict:
    code = ("import json, sys; from cadence.actors.tasks import math_verifier as m; text = sys.stdin.read(); "
            "ok = m.is_equivalent(sys.argv[1], text); "
            "check = getattr(m, 'check', None); refused = check(sys.argv[1], text).refused if check else None; "
            "print(json.dumps({'equivalent': ok, 'refused': refused}))")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        out = subprocess.run([sys.executable, "-c", code, reference], input=completion, capture_output=True,
                             text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the verifier did not return within {timeout:.0f} s on {completion[:80]!r}")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(REPRODUCERS))
def test_reproducers_are_refused_quickly_and_score_zero(name):
    completion, reason = REPRODUCERS[name]
    verdict = _check_in_child("1", completion)
    if name == "spaces":  # no hostile arithmetic there, only a slow scan: bounded is the point
        return
    assert verdict == {"equivalent": False, "refused": reason}


@pytest.mark.parametrize("text", ["__import__('os').system('true')", "\\int_0^1 x dx", "a < b", "x_1",
                                  "\\lambda x.x", "\\mathcal{F}", "1 : 1", "\\sum 1", "'1'", "1 2"])
def test_outside_the_allow_list_is_refused_as_syntax(text):
    with pytest.raises(math_expr.Refused) as e:
        math_expr.parse(text)
    assert e.value.reason == "syntax"


@pytest.mark.parametrize("text", ["9^{9^{9^9}}", "(10^{10})!", "100000!", "2^{2^{64}}", "\\sqrt{10^{99999}}",
                                  "10^{-99999}", "\\sin(10^{100})", "e^{10^{9}}", "x^{10^{30}}",
                                  "\\binom{10^{30}}{3}"])
def test_big_values_are_refused_before_they_are_computed(text):
    with pytest.raises(math_expr.Refused) as e:
        math_expr.same(math_expr.parse("1"), math_expr.parse(text))
    assert e.value.reason == "too_large"


SAME = [
    ("1/2", "0.5"), ("0.5", "\\frac{1}{2}"), ("\\frac{3}{4}", "3/4"), ("1/3", "0.3333333"),
    ("\\sqrt{2}", "\\frac{\\sqrt{50}}{5}"), ("\\sqrt{2}", "1.41421356"), ("x^2+2x+1", "(x+1)^2"),
    ("1024", "2^{10}"), ("120", "5!"), ("10", "\\binom{5}{2}"), ("-2", "\\sqrt[3]{-8}"), ("3.5", "3\\frac{1}{2}"),
    ("1000", "1,000"), ("5", "x = 5"), ("72", "72 clips"), ("10", "10 \\text{ cm}"), ("90", "90^\\circ"),
    ("(1, 2)", "(1,2)"), ("\\{1, 2\\}", "2, 1"), ("2\\pi", "\\pi + \\pi"),
    ("\\frac{\\sqrt{3}}{2}", "\\cos(\\pi/6)"), ("2", "\\log 100"), ("3", "\\ln(e^3)"),
]
DIFFERENT = [("1/3", "0.333"), ("(1, 2)", "(2, 1)"), ("x", "y"), ("x^2", "x^3"), ("2", "\\sqrt{2}"),
             ("10^{100}", "10^{100} + 1"), ("1", "1.001"), ("0", "1/0")]


@pytest.mark.parametrize("a, b", SAME)
def test_equivalent_forms_are_the_same(a, b):
    assert math_expr.same(math_expr.parse(a), math_expr.parse(b))


@pytest.mark.parametrize("a, b", DIFFERENT)
def test_different_values_are_not(a, b):
    assert not math_expr.same(math_expr.parse(a), math_expr.parse(b))


def test_final_answer_extraction_is_the_last_answer_the_text_gives():
    fa = math_verifier.final_answer
    assert fa("It could be 3, but \\boxed{4}") == "4"
    assert fa("Work: 2 + 2 = 4.\n#### 17") == "17"
    assert fa("so we get 3/4.") == "3/4"
    assert fa("3 apples, then 4 more") == "4"
    assert fa("The answer is $\\frac{1}{2}$ of them, not 3") == "\\frac{1}{2}"
    assert fa("$x = 5$ and then (so 72)") == "72"
    assert fa("no numbers here") == ""
    assert math_verifier.reference_answer("We add: $\\frac14 = \\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert math_verifier.reference_answer("Natalia sold 72.\n#### 1,072") == "1072"


def test_references_outside_the_allow_list_compare_as_text():
    assert math_verifier.is_equivalent("\\text{(C)}", "The answer is \\boxed{C}")
    assert math_verifier.is_equivalent("(0, 1]", "\\boxed{(0,1]}")
    assert not math_verifier.is_equivalent("(0, 1]", "\\boxed{(0,1)}")


def test_random_allowed_expressions_all_return_quickly():
    """Fuzz: random trees over the allow-list (huge literals, towers, factorials, roots, functions);
    every comparison returns a verdict, none raises, none takes long (the child has 60 s for 2000)."""
    rng = random.Random(0)
    atoms = ["1", "2", "9", "10", "999", "0", "0.5", "x", "\\pi", "12345678901234567890"]

    def expr(depth):
        if depth == 0 or rng.random() < 0.2:
            return rng.choice(atoms)
        a, b = expr(depth - 1), expr(depth - 1)
        return rng.choice([f"({a})+({b})", f"({a})*({b})", f"\\frac{{{a}}}{{{b}}}", f"({a})^{{{b}}}",
                           f"\\sqrt{{{a}}}", f"({a})!", f"\\binom{{{a}}}{{{b}}}", f"\\sin({a})", f"\\sqrt[3]{{{a}}}"])

    cases = [f"\\boxed{{{expr(6)}}}" for _ in range(2000)]
    code = ("import json, sys; from cadence.actors.tasks import math_verifier as m; "
            "cases = json.load(sys.stdin); "
            "print(json.dumps([m.check('1', c).refused for c in cases]))")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        out = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), capture_output=True,
                             text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("2000 random allow-listed answers took over 60 s")
    assert out.returncode == 0, out.stderr[-2000:]
    refused = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(refused) <= {"", "too_large", "syntax"} and "too_large" in refused and "" in refused


INLINE = """
import json, sys
from cadence.actors.rewards.scoring import InlineScorer
from cadence.actors.tasks.base import Completion
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.learner.models.hf_random import write_tiny_tokenizer
from cadence.learner.models.hf_tokenizer import HFTokenizer
write_tiny_tokenizer(sys.argv[2])
task = make_task(TaskConfig(name="jsonl", path=sys.argv[1], heldout_size=3, reward_workers=0), HFTokenizer(sys.argv[2]))
prompt = task.heldout()[0]
items = [(prompt, Completion((), text)) for text in json.load(sys.stdin)]
scores = InlineScorer(task).score_groups([items])[0]
print(json.dumps([[s.reward, s.metrics["verifier_refused"], s.error] for s in scores]))
"""


def test_inline_scoring_is_bounded_and_counts_refusals(tmp_path):
    """task.reward_workers=0 scores in the caller's thread: the verifier itself must be bounded."""
    texts = [REPRODUCERS[k][0] for k in ("lambda", "tower", "binom")]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        out = subprocess.run([sys.executable, "-c", INLINE, SAMPLE, str(tmp_path)], input=json.dumps(texts),
                             capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("inline scoring of the reproducers did not return within 60 s")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[0.0, 1.0, ""]] * 3


def test_threads_verifying_at_once_keep_their_precision():
    """Actor threads score inline at once: each gets its own mpmath context (the global one's
    precision is shared and moved by mpmath's own functions)."""
    import threading
    pairs = [("\\sqrt{2}", "\\frac{\\sqrt{50}}{5}"), ("\\frac{\\pi}{4}", "\\frac{2\\pi}{8}"),
             ("\\frac{\\sqrt{3}}{2}", "\\cos(\\pi/6)"), ("2", "\\log 100"), ("\\sqrt[3]{2}", "2^{1/3}")]
    results = []

    def work():
        results.append(all(math_verifier.is_equivalent(a, f"\\boxed{{{b}}}") for _ in range(100) for a, b in pairs))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [True] * 8
