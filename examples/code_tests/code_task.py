"""A code task graded by running its unit tests in a sandboxed subprocess (sandbox.py).

    cadence train --config examples/code_tests/config.yaml model.path=/ckpt/Qwen2.5-0.5B-Instruct

Each record of problems.jsonl: {"prompt": "Write a Python function add(a, b) ...",
"tests": ["assert add(1, 2) == 3", ...]}. The reward is the fraction of tests that pass; the
program is the completion's first ```python fenced block (or the whole completion). exact_match is
"all tests pass". The model's code runs only inside the sandbox, in a reward worker process.
"""
from __future__ import annotations

import os
import re
import sys

from cadence import RecordsTask, Score

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sandbox import pass_rate  # noqa: E402  (a sibling module: this example is not a package)

FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def extract_program(text: str) -> str:
    block = FENCE.search(text)
    return block.group(1) if block else text


def reward(prompt, completion) -> Score:
    rate = pass_rate(extract_program(completion.text), list(prompt.metadata["tests"]), timeout_s=5.0)
    return Score(rate, exact_match=rate == 1.0, metrics={"tests_passed": rate})


def make(cfg, tokenizer):
    return RecordsTask(cfg, tokenizer, reward, name="code")
