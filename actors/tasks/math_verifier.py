"""Math answer verification on text: is the model's final answer equivalent to the reference?

Uses Hugging Face's ``math-verify`` (LaTeX/expression parsing with SymPy): "0.5", "1/2",
"\\frac{1}{2}" and "\\boxed{\\frac12}" are all the same answer. Model text is parsed, never
evaluated as code. math-verify's own timeouts use SIGALRM, which only works on the main thread,
so they are switched off (actors score on worker threads) and the text is bounded in length
instead.
"""

from __future__ import annotations

import logging
import re

import math_verify

# Long runs of model text are where parsing gets slow; the final answer sits at the end.
MAX_COMPLETION_CHARS = 4000
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
    if not pred:
        return False
    return bool(math_verify.verify(gold, pred, timeout_seconds=None))
