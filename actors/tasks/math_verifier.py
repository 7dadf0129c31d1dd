"""Math answer verification on text: is the model's final answer equivalent to the reference?

    verdict = check(parse_reference("#### 72"), completion_text)   # Verdict(equivalent, refused)
    is_equivalent("1/2", "The answer is \\boxed{\\frac12}")         # True

"0.5", "1/2", "\\frac{1}{2}" and "\\boxed{\\frac12}" are the same answer; GSM8K's "#### 72" and
MATH's \\boxed{} both work. Which part of a completion is its final answer, in order: the last
"#### X" (GSM8K's mark), the last \\boxed{} (or \\fbox{}), the first number or math span within 50
characters after the last "answer", else the last number or math span in the text ($...$,
\\(...\\), \\[...\\], a run of digits and operators, or a bare \\frac{}{} or \\sqrt{}). Each of
these scans is linear in the text, and only the last MAX_COMPLETION_CHARS characters are read.

What model text can do here: nothing runs. The answer is parsed by an allow-list (math_expr.py:
numbers, arithmetic, fractions, roots, powers, a few functions) and every intermediate's size is
estimated before it is computed, so scoring one completion is bounded in time wherever it runs
(inline, in a reward worker, in ``cadence eval``). An answer outside the allow-list, or one whose
value would be too big, is refused: it scores 0 and the refusal is counted (Verdict.refused; the
math tasks report it as the metric ``verifier_refused``). A reference outside the allow-list (an
interval, a word, a choice "(C)") is compared as normalized text.
"""
from __future__ import annotations

import dataclasses
import functools
import re

from cadence.actors.tasks import math_expr
from cadence.actors.tasks.base import Completion, Prompt, Score
from cadence.actors.tasks.math_expr import Refused

# The final answer sits at the end of a completion; reading only the end bounds every scan.
MAX_COMPLETION_CHARS = 4000
ANCHOR_WINDOW = 50  # "the answer is X": X must start this close to "answer"
# A run of digits and operators (plain text answers such as "3/4" or "12 + 30 = 42"). One greedy
# character class, so finditer is linear.
_PLAIN_SPAN = re.compile(r"(?<![\w.])-?\(?\d[\d.,+\-*/^()×÷= ]*")
_TRIM = " .,=+-*/^×÷"
# A fraction or root written in LaTeX outside math delimiters ("it gives \frac{1}{2}.").
_BARE_LATEX = re.compile(r"-?\\(?:[dt]?frac|sqrt)\{[^{}\s]{1,40}\}(?:\{[^{}\s]{1,40}\})?")


@dataclasses.dataclass(frozen=True)
class Answer:
    """A final answer: its text, and its allow-listed parse (None: refused, see ``refused``)."""

    text: str  # "" when the text holds no answer
    node: tuple | None = None
    refused: str = ""  # "" or why the parse refused it: syntax | too_large


@dataclasses.dataclass(frozen=True)
class Verdict:
    equivalent: bool
    refused: str = ""  # "" or why the completion's answer was refused (syntax | too_large)


def reference_answer(answer_text: str) -> str:
    """The part of a dataset's answer field to compare against.

    GSM8K writes the solution then "#### 72": the text after the last "####" (its line, commas
    dropped). MATH's solution: its last \\boxed{}. A field with $...$ math: the last span. Anything
    else is the answer whole.
    """
    text = answer_text[-MAX_COMPLETION_CHARS:]
    mark = _gsm8k_mark(text)
    if mark is not None:
        return mark
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "$" in text or "\\(" in text or "\\[" in text:
        span = _last_math_span(text)
        if span is not None:
            return span[2]
    return text.strip()


def _gsm8k_mark(text: str) -> str | None:
    i = text.rfind("####")
    if i < 0:
        return None
    return text[i + 4:].split("\n", 1)[0].strip().replace(",", "")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (braces balanced; unclosed: to the end)."""
    i = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if i < 0:
        return None
    j = text.find("{", i)
    if j < 0 or text[i:j].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for k in range(j, len(text)):
        c = text[k]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1:k]
    return text[j + 1:]


def _math_envs(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of $...$, $$...$$, \\(...\\), \\[...\\] spans, left to right; one pass."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n and text[i + 1] in "([":
            close = "\\)" if text[i + 1] == "(" else "\\]"
            j = text.find(close, i + 2)
            if j < 0:
                return out
            out.append((i, j + 2, text[i + 2:j]))
            i = j + 2
        elif c == "\\":
            i += 2  # an escaped character (\$ is a dollar sign, not math)
        elif c == "$":
            delim = "$$" if text.startswith("$$", i) else "$"
            j = text.find(delim, i + len(delim))
            while j > 0 and text[j - 1] == "\\":
                j = text.find(delim, j + 1)
            if j < 0:
                return out
            out.append((i, j + len(delim), text[i + len(delim):j]))
            i = j + len(delim)
        else:
            i += 1
    return out


def _plain_spans(text: str) -> list[tuple[int, int, str]]:
    out = []
    for m in _PLAIN_SPAN.finditer(text):
        start, span = m.start(), m.group().rstrip(_TRIM)
        if span.count("(") < span.count(")"):  # "(so 72)" or "is 7)": the bracket is prose
            span = span.rstrip(")").rstrip(_TRIM)
        if span.startswith("(") and span.count("(") > span.count(")"):
            start, span = start + 1, span[1:]
        if any(ch.isdigit() for ch in span):
            out.append((start, start + len(span), span))
    out += [(m.start(), m.end(), m.group()) for m in _BARE_LATEX.finditer(text)]
    return out


def _last_math_span(text: str):
    spans = _math_envs(text) + _plain_spans(text)
    return max(spans, key=lambda s: (s[1], -s[0]), default=None)


def _anchored(text: str):
    i = text.lower().rfind("answer")
    if i < 0:
        return None
    rest = text[i + 6:]
    spans = [s for s in _math_envs(rest) + _plain_spans(rest) if s[0] <= ANCHOR_WINDOW]
    return min(spans, key=lambda s: (s[0], -s[1]), default=None)


def final_answer(completion: str) -> str:
    """The text of a completion's final answer ("" if it holds none); see the module docstring."""
    text = completion[-MAX_COMPLETION_CHARS:]
    for pick in (_gsm8k_mark, _last_boxed):
        found = pick(text)
        if found is not None:
            return found
    span = _anchored(text) or _last_math_span(text)
    return "" if span is None else span[2]


def _parse(text: str) -> Answer:
    text = text.strip()
    if not text:
        return Answer("")
    try:
        return Answer(text, math_expr.parse(text))
    except Refused as e:
        return Answer(text, None, e.reason)
    except RecursionError:
        return Answer(text, None, "too_large")


@functools.lru_cache(maxsize=4096)
def parse_reference(answer_text: str) -> Answer:
    """The reference answer of a dataset's answer field (see ``reference_answer``), parsed."""
    return _parse(reference_answer(answer_text))


def parse_answer(completion: str) -> Answer:
    """A completion's final answer (``final_answer``), parsed."""
    return _parse(final_answer(completion))


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_TEXT_NOISE = re.compile(r"\\(?:left|right|[,;:! ])|\s|\$")


def _as_text(answer: str) -> str:
    """An answer as text for references outside the allow-list: wrappers, spaces, $ dropped."""
    s = _TEXT_NOISE.sub("", _TEXT_WRAPPER.sub(r"\1", answer)).rstrip(".")
    if len(s) == 3 and s[0] == "(" and s[2] == ")":  # a choice: "(C)" is "C"
        s = s[1]
    return s.lower()


def check(reference: Answer | str, completion: str) -> Verdict:
    """Is the completion's final answer the reference's? reference: a parsed reference
    (``parse_reference``) or the answer field's text. Never raises for what the text holds."""
    gold = parse_reference(reference) if isinstance(reference, str) else reference
    if not gold.text:
        return Verdict(False)
    pred = parse_answer(completion)
    if not pred.text:
        return Verdict(False)
    if gold.node is None:
        return Verdict(_as_text(gold.text) == _as_text(pred.text))
    if pred.node is None:
        return Verdict(False, pred.refused)
    try:
        return Verdict(math_expr.same(gold.node, pred.node))
    except Refused as e:
        return Verdict(False, e.reason)
    except (RecursionError, ArithmeticError, ValueError):
        return Verdict(False, "too_large")


def is_equivalent(reference: Answer | str, completion: str) -> bool:
    """True iff the completion's final answer equals the reference answer (see ``check``)."""
    return check(reference, completion).equivalent


@dataclasses.dataclass(frozen=True)
class MathAnswerReward:
    """The math tasks' reward: 1.0 iff the completion's final answer is the one in the prompt's
    record (``prompt.metadata[answer_field]``), exact match the same verdict, and the metric
    ``verifier_refused`` (1.0 when the completion's answer was refused). It reads nothing but the
    prompt, so reward workers run it without the dataset (Task.scoring)."""

    answer_field: str = "answer"

    def __call__(self, prompt: Prompt, completion: Completion) -> Score:
        verdict = check(parse_reference(str(prompt.metadata[self.answer_field])), completion.text)
        ok = verdict.equivalent
        return Score(1.0 if ok else 0.0, ok, {"verifier_refused": 1.0 if verdict.refused else 0.0})
