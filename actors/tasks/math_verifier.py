"""Math answer verification on text: is the model's final answer equivalent to the reference?

Uses Hugging Face's ``math-verify`` (LaTeX/expression parsing with SymPy): "0.5", "1/2",
"\\frac{1}{2}" and "\\boxed{\\frac12}" are all the same answer.

What model text can do here: math-verify hands LaTeX to latex2sympy and plain expressions to
SymPy's ``parse_expr`` (which evaluates Python), but its expression pattern only lets digits,
spaces, ``. + - * × / ÷ ^ ( )`` reach ``parse_expr``, so names (``__import__``, ``lambda``) never
do; tests/actors/math_verifier_hostile_test.py holds it to that. What can still hurt is
arithmetic: ``9**9**9**9`` parses in milliseconds and then makes ``verify`` compute a number
with ~10^8 digits. So a parsed answer with a nested or large exponent, a large factorial or a
huge literal is refused (``is_tame``) before ``verify`` sees it; and the JSONL task scores in the
reward worker pool (actors/rewards/), whose time and memory limits bound anything this misses.
math-verify's own timeouts use SIGALRM, which only works on a main thread, so they are off and
the text is bounded in length instead.
"""

from __future__ import annotations

import logging
import re

import math_verify

# Long runs of model text are where parsing gets slow; the final answer sits at the end.
MAX_COMPLETION_CHARS = 4000
# Bounds on what verify() may compute: 10**1000 or 1000! are instant, 9**(9**9) is not.
MAX_EXPONENT = 1000
MAX_FACTORIAL = 1000
MAX_INTEGER_DIGITS = 2000
_GSM8K_MARK = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def _drop_timeout_notice(record: logging.LogRecord) -> bool:
    # math-verify warns on every first call that its timeout is off; that is deliberate here.
    return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_drop_timeout_notice)


def reference_answer(answer_text: str) -> str:
    """The part of a dataset's answer field to compare against.

    GSM8K writes the solution then "#### 72": the number after "####" is the answer (commas
    dropped). Anything else (MATH's solution with \\boxed{}, or a bare answer) is used whole.
    """
    mark = _GSM8K_MARK.search(answer_text)
    if mark:
        return mark.group(1).replace(",", "")
    return answer_text


def parse_answer(text: str):
    """math-verify's parse of text (last boxed / LaTeX / plain expression), no timeouts."""
    return math_verify.parse(text[-MAX_COMPLETION_CHARS:], parsing_timeout=None)


def parse_reference(answer_text: str):
    """Parsed reference answer of a dataset's answer field (see ``reference_answer``).

    A bare reference such as "\\sqrt{2}/2" is LaTeX without delimiters, which math-verify only
    reads inside "$...$", so it is wrapped first.
    """
    text = reference_answer(answer_text).strip()
    if "$" not in text and "\\boxed" not in text:
        text = f"${text}$"
    return parse_answer(text)


def _with_gsm8k_mark(completion: str) -> str:
    # A model that learned GSM8K's format ends with "#### 72"; box it so it wins over earlier numbers.
    mark = _GSM8K_MARK.search(completion)
    return completion if not mark else completion + f" \\boxed{{{mark.group(1).replace(',', '')}}}"


def is_tame(parsed) -> bool:
    """False when a parsed answer holds arithmetic that would take verify() unbounded time.

    Refused: an exponent that is itself a power or factorial or exceeds MAX_EXPONENT in magnitude,
    a factorial of more than MAX_FACTORIAL, an integer literal longer than MAX_INTEGER_DIGITS.
    """
    import sympy

    for item in parsed:
        if not isinstance(item, sympy.Basic):
            continue
        for node in sympy.preorder_traversal(item):
            if isinstance(node, sympy.Pow):
                exp = node.exp
                if exp.has(sympy.Pow, sympy.factorial, sympy.factorial2, sympy.gamma):
                    return False
                if any(abs(n) > MAX_EXPONENT for n in exp.atoms(sympy.Number)):
                    return False
            elif isinstance(node, (sympy.factorial, sympy.factorial2, sympy.gamma, sympy.subfactorial)):
                arg = node.args[0]
                if arg.has(sympy.Pow, sympy.factorial) or any(abs(n) > MAX_FACTORIAL
                                                                for n in arg.atoms(sympy.Number)):
                    return False
            elif isinstance(node, sympy.Integer) and abs(int(node)).bit_length() > MAX_INTEGER_DIGITS * 3.33:
                return False
    return True


def is_equivalent(reference, completion: str) -> bool:
    """True iff the completion's final answer equals the reference answer.

    Args:
      reference: a parsed reference (``parse_reference(text)``) or the answer field's text.
      completion: the decoded model completion.

    Returns:
      False for an empty or unparsable completion.
    """
    gold = parse_reference(reference) if isinstance(reference, str) else reference
    if not gold:
        return False
    pred = parse_answer(_with_gsm8k_mark(completion))
    if not pred or not is_tame(pred):
        return False
    return bool(math_verify.verify(gold, pred, timeout_seconds=None))
