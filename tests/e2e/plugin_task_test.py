"""Whole runs of tasks written outside the repository, through the `cadence train` command.

1. A task module in a temporary directory (task.name=digits_task:make): no reference answers, a
   plain-Python reward on the decoded text; the training reward rises.
2. The same with hostile rewards mixed in (sleeps forever, raises, allocates without bound, kills
   its own process): each scores 0 and is counted in the metrics, and the run finishes with a
   clean ledger.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cadence.launch.metrics import read_metrics

pytestmark = pytest.mark.slow

TASK = '''
import os, signal, time
import numpy as np
from cadence import Prompt, Score

class DigitsTask:
    """Write digits: per character of the completion (4 at most), half a point for a digit and
    another half when it is the prompt's digit (no reference answer; the reward reads the text)."""
    max_prompt_len = 3
    max_completion_len = 4

    def __init__(self, cfg, tokenizer):
        self.name, self.tokenizer, self.seed = "digits", tokenizer, cfg.seed
        self.hostile = cfg.args.get("hostile_dir", "")  # misbehave once per kind (marker files)

    def _make(self, split, index):
        d = int(np.random.default_rng([self.seed, index, split == "heldout"]).integers(0, 10))
        return Prompt(f"digits/{split}/{index}", index, (self.tokenizer.bos_id, *self.tokenizer.encode(f"{d}>")),
                      text=f"{d}>", metadata={"digit": str(d)})

    def prompt(self, index):
        return self._make("train", index)

    def heldout(self):
        return [self._make("heldout", i) for i in range(32)]

    def score(self, prompt, completion):
        if self.hostile and prompt.prompt_id.startswith("digits/train/") and prompt.index < 4:
            try:  # the first completion scored for training prompt i misbehaves in way i
                os.close(os.open(os.path.join(self.hostile, str(prompt.index)), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                if prompt.index == 0:
                    time.sleep(3600)
                if prompt.index == 1:
                    raise RuntimeError("reward bug")
                if prompt.index == 2:
                    hog = []
                    while True:
                        hog.append(bytearray(16 << 20))
                os.kill(os.getpid(), signal.SIGKILL)
        text = completion.text
        points = sum(0.5 * c.isdigit() + 0.5 * (c == prompt.metadata["digit"]) for c in text[:4])
        return Score(points / 4, metrics={"length": len(text)})

def make(cfg, tokenizer):
    return DigitsTask(cfg, tokenizer)
'''


def run_cli(tmp_path, *overrides):
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "digits_task.py").write_text(TASK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugins), os.getcwd()]))
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", "task.name=digits_task:make",
                          f"run.dir={run}", "run.progress=false", "learner.sft.steps=30",
                          "learner.batch_size=64", "actors.prompts_per_call=8", *overrides],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), read_metrics(str(run))


def test_a_task_module_outside_the_repo_trains_and_its_reward_rises(tmp_path):
    summary, rows = run_cli(tmp_path, "run.steps=60", "run.eval_every=30")
    steps = [r for r in rows if r["step"] > 0]
    first = np.mean([r["reward/mean"] for r in steps[:5]])
    last = np.mean([r["reward/mean"] for r in steps[-5:]])
    assert last > first + 0.15, (first, last)
    assert "eval/exact_match" not in rows[0] and "eval/reward" in rows[0]  # no answers: the reward
    assert "eval/length" in rows[0] and "task/length" in steps[0]  # the task's own metric
    assert summary["reward_errors"] == {} and summary["ledger"]["in_flight"] == 0


def test_hostile_rewards_score_zero_are_counted_and_the_run_finishes(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    summary, rows = run_cli(tmp_path, "run.steps=6", "run.eval_every=0", f"task.args.hostile_dir={markers}",
                            "task.reward_timeout_s=5", "task.reward_memory_mb=320")
    counted = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("reward/errors/"):
                counted[k.removeprefix("reward/errors/")] = counted.get(k.removeprefix("reward/errors/"), 0) + v
    # one of each, in the first groups (all consumed by the 6 steps' 24 groups)
    assert counted == {"timeout": 1, "error": 1, "memory": 1, "crashed": 1}, counted
    assert summary["reward_errors"] == counted
    assert summary["steps"] == 6 and summary["samples"] == 6 * 64
    assert summary["ledger"]["in_flight"] == 0  # ledger.verify() passed at the end of train()
