"""Math verifier throughput: completions/s of the allow-list verifier vs the math-verify one it
replaced (issue 31, finding 3), on the math sample (actors/tasks/data/math_sample.jsonl).

Each record gets completions a model writes: the answer boxed, as GSM8K's "#### N", as the last
number of some prose, in LaTeX, and wrong ones of each shape (a few hundred characters each).
Both verifiers score the same completions against the same references, in this process, one at a
time (what a reward worker does); the reference is parsed once per record (as the tasks cache it).
The baseline is the previous verifier exactly: math_verify.parse (timeouts off), the exponent /
factorial guard, math_verify.verify. Prints one JSON line: completions/s of each, the ratio, and
how often the two verdicts agree.

    python benchmarks/verifier_bench.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

from cadence.actors.tasks import math_verifier

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "actors", "tasks", "data", "math_sample.jsonl")
PROSE = ("Let me work through this step by step. First I read the problem carefully and write down "
         "what is given, then I compute the intermediate values one at a time and check each. ")


# ---- the previous verifier (git history: actors/tasks/math_verifier.py before issue 31) -------------
_GSM8K_MARK = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def _legacy_parse(text):
    import math_verify
    return math_verify.parse(text[-4000:], parsing_timeout=None)


def _legacy_reference(answer_text):
    mark = _GSM8K_MARK.search(answer_text)
    text = (mark.group(1).replace(",", "") if mark else answer_text).strip()
    if "$" not in text and "\\boxed" not in text:
        text = f"${text}$"
    return _legacy_parse(text)


def _legacy_is_tame(parsed) -> bool:
    import sympy
    for item in parsed:
        if not isinstance(item, sympy.Basic):
            continue
        for node in sympy.preorder_traversal(item):
            if isinstance(node, sympy.Pow):
                exp = node.exp
                if exp.has(sympy.Pow, sympy.factorial, sympy.factorial2, sympy.gamma):
                    return False
                if any(abs(n) > 1000 for n in exp.atoms(sympy.Number)):
                    return False
            elif isinstance(node, (sympy.factorial, sympy.factorial2, sympy.gamma, sympy.subfactorial)):
                arg = node.args[0]
                if arg.has(sympy.Pow, sympy.factorial) or any(abs(n) > 1000 for n in arg.atoms(sympy.Number)):
                    return False
            elif isinstance(node, sympy.Integer) and abs(int(node)).bit_length() > 2000 * 3.33:
                return False
    return True


def _legacy_is_equivalent(gold, completion: str) -> bool:
    import math_verify
    if not gold:
        return False
    mark = _GSM8K_MARK.search(completion)
    if mark:
        completion = completion + f" \\boxed{{{mark.group(1).replace(',', '')}}}"
    pred = _legacy_parse(completion)
    if not pred or not _legacy_is_tame(pred):
        return False
    return bool(math_verify.verify(gold, pred, timeout_seconds=None))


# ---- the workload ----------------------------------------------------------------------------------

def completions_for(answer: str) -> list[str]:
    wrong = "17" if answer != "17" else "18"
    return [
        f"{PROSE}So the answer is \\boxed{{{answer}}}.",
        f"{PROSE}\n#### {answer}",
        f"{PROSE}Adding it up gives {answer}.",
        f"{PROSE}We get $x = {answer}$.",
        f"{PROSE}So the answer is \\boxed{{{wrong}}}.",
        f"{PROSE}\n#### {wrong}",
        f"{PROSE}Adding 3 and 4 gives {wrong}.",
        f"{PROSE}Therefore $\\frac{{{wrong}}}{{2}} \\cdot 2$ is the result.",
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    records = [json.loads(line) for line in open(SAMPLE, encoding="utf-8") if line.strip()]
    cases = []
    for r in records:
        short = math_verifier.reference_answer(str(r["answer"]))
        for c in completions_for(short):
            cases.append((str(r["answer"]), c))

    def run(parse_ref, equivalent):
        refs = {text: parse_ref(text) for text, _ in cases}  # parsed once, as the tasks cache them
        verdicts = [equivalent(refs[text], c) for text, c in cases]  # warm-up (imports, caches)
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for text, c in cases:
                equivalent(refs[text], c)
            times.append(time.perf_counter() - t0)
        return len(cases) / statistics.median(times), verdicts

    new_rate, new = run(math_verifier.parse_reference, math_verifier.is_equivalent)
    old_rate, old = run(_legacy_reference, _legacy_is_equivalent)
    agree = sum(x == y for x, y in zip(new, old)) / len(cases)
    print(json.dumps({"bench": "math_verifier", "completions": len(cases), "records": len(records),
                      "allowlist_completions_per_second": round(new_rate, 1),
                      "math_verify_completions_per_second": round(old_rate, 1),
                      "speedup": round(new_rate / old_rate, 2), "verdicts_agree": round(agree, 4),
                      "allowlist_correct": sum(new[i] == (i % 8 < 4) for i in range(len(cases))),
                      "math_verify_correct": sum(old[i] == (i % 8 < 4) for i in range(len(cases)))}))


if __name__ == "__main__":
    main()
