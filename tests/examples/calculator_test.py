"""examples/calculator: the environment's rules (fast), and a whole CPU run in which the tiny
model learns to use the tool (slow): the held-out tool-use rate and reward both rise."""
import json
import os
import subprocess
import sys

import pytest

from actors.rewards.scoring import make_completion
from actors.tasks.config import TaskConfig
from actors.tasks.registry import make_task
from launch.metrics import read_metrics
from learner.models.char_tokenizer import CharTokenizer

HERE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "calculator")
NAME = os.path.join(HERE, "calculator_task.py") + ":make"


def test_environment_answers_calls_and_scores_answers():
    tok = CharTokenizer()
    task = make_task(TaskConfig(name=NAME, args={"digits": 2}), tok)
    p = task.prompt(3)
    a, b, total = p.metadata["a"], p.metadata["b"], p.metadata["sum"]
    assert p.text == f"{a}+{b}="
    env = task.environment(p)
    step = env.step(make_completion(tok, [*tok.encode("c"), tok.eos_id]))
    assert tok.decode(step.observation) == f":{total}" and not step.done and step.metrics == {"tool_use": 1.0}
    again = env.step(make_completion(tok, tok.encode("c10+5")))  # an explicit expression; not a first use
    assert tok.decode(again.observation) == ":15" and again.metrics == {"tool_use": 0.0}
    assert tok.decode(env.step(make_completion(tok, tok.encode("cx"))).observation) == ":err"
    final = env.step(make_completion(tok, [*tok.encode(str(total)), tok.eos_id]))
    assert final.done and final.reward == 1.0 and final.metrics == {"correct": 1.0}
    half = task.environment(p).step(make_completion(tok, tok.encode(str(total)[:-1] + "x")))
    assert half.done and 0 < half.reward < 1


@pytest.mark.slow
def test_tiny_model_learns_to_use_the_calculator(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-m", "launch.cli", "train", "--config", os.path.join(HERE, "config.yaml"),
                          f"run.dir={run}", "run.steps=150", "run.eval_every=75", "run.progress=false"],
                         capture_output=True, text=True, timeout=1200, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    evals = [r for r in read_metrics(str(run)) if "eval/reward" in r]
    first, last = evals[0], evals[-1]
    assert last["eval/tool_use"] >= first["eval/tool_use"] + 0.3, (first, last)
    assert last["eval/reward"] >= first["eval/reward"] + 0.1, (first, last)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["reward_errors"] == {} and summary["ledger"]["in_flight"] == 0
