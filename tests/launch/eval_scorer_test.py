"""`cadence eval` scores with the run's scorer (issue 31, finding 3: scoring bounded wherever it
runs). It used to score inline, so a reward that hangs hung the command; now the run's reward
workers and their time limit apply, and the failures are reported (eval/reward_errors).

The run directory is made the way `cadence train` leaves it (config.yaml and the params), for the
built-in tiny model and a plug-in task whose reward never returns.
"""
import json
import os
import subprocess
import sys

import pytest

from cadence.launch import artifacts
from cadence.launch.config import load_config
from cadence.learner.models.policy import build_policy

HANGING_TASK = '''
import dataclasses, time
from cadence.actors.tasks.sort import SortTask


class Hanging(SortTask):
    def score(self, prompt, completion):
        time.sleep(3600)


def make(cfg, tokenizer):
    return Hanging(dataclasses.replace(cfg, name="sort"), tokenizer)
'''


def test_cadence_eval_bounds_a_hanging_reward(tmp_path):
    task_file = tmp_path / "hanging_task.py"
    task_file.write_text(HANGING_TASK)
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(overrides=[f"task.name={task_file}:make", "task.num_digits=3", "task.heldout_size=2",
                                 "task.reward_workers=1", "task.reward_timeout_s=1", "task.reward_memory_mb=0",
                                 f"run.dir={run}"])
    artifacts.write_config(cfg, str(run))
    artifacts.save_params(str(run), build_policy(cfg).params)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "eval", str(run)], capture_output=True,
                             text=True, timeout=240, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("cadence eval did not return within 240 s: the hanging reward was not bounded")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["eval/reward_errors"] == 2 and result["eval/exact_match"] == 0.0
