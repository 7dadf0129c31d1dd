"""examples/code_tests: the sandboxed grader and the task built from the example's files."""
import os
import sys
import time

import pytest

from cadence.actors.tasks.base import Completion
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.learner.models.hf_random import write_tiny_tokenizer
from cadence.learner.models.hf_tokenizer import HFTokenizer

HERE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "code_tests")
sys.path.insert(0, HERE)
from sandbox import pass_rate, run_test  # noqa: E402

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


@pytest.mark.parametrize("program, expected", [
    ("def add(a, b):\n    return a + b", 1.0),
    ("def add(a, b):\n    return a - b", 0.0),  # wrong: 1 - 2 != 3 and -1 - 1 != 0
    ("import os\nos._exit(0)", 0.0),  # exits before the asserts: no token, no pass
    ("while True:\n    pass", 0.0),  # the CPU limit / timeout
    ("x = bytearray(2 << 30)", 0.0),  # over the memory limit
    ("print('not even python", 0.0),
])
def test_grader(program, expected):
    assert pass_rate(program, TESTS, timeout_s=3.0, cpu_s=2) == expected


def test_a_forking_program_leaves_nothing_running(tmp_path):
    marker = tmp_path / "alive"
    program = (f"import os, time\nif os.fork() == 0:\n    time.sleep(2)\n    open({str(marker)!r}, 'w').close()\n"
               "    os._exit(0)\ndef add(a, b):\n    return a + b")
    assert run_test(program, TESTS[0], timeout_s=5.0)
    time.sleep(3)
    assert not marker.exists()  # the child was killed with the session


def test_task_from_the_example_files_scores_a_fenced_program(tmp_path):
    write_tiny_tokenizer(str(tmp_path))  # a byte-level BPE: any text encodes
    args = {"path": os.path.join(HERE, "problems.jsonl"), "prompt_field": "prompt"}
    task = make_task(TaskConfig(name=os.path.join(HERE, "code_task.py") + ":make", args=args,
                                heldout_size=2), HFTokenizer(str(tmp_path)))
    prompt = next(p for p in [task.prompt(i) for i in range(6)] if "add(a, b)" in p.metadata["prompt"])
    score = task.score(prompt, Completion((), "Here:\n```python\ndef add(a, b):\n    return a + b\n```"))
    assert score.reward == 1.0 and score.exact_match is True
