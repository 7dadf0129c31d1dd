"""examples/calculator: the environment's rules (fast), and a whole CPU run in which the tiny
model learns to use the tool (slow): the held-out tool-use rate and reward both rise."""
import json
import os
import subprocess
import sys

import pytest

from cadence.actors.rewards.scoring import make_completion
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.launch.metrics import read_metrics
from cadence.learner.models.char_tokenizer import CharTokenizer

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
    out = subprocess.run([sys.executable, "-m", "cadence.launch.cli", "train", "--config", os.path.join(HERE, "config.yaml"),
                          f"run.dir={run}", "run.steps=150", "run.eval_every=75", "run.progress=false"],
                         capture_output=True, text=True, timeout=1200, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    evals = [r for r in read_metrics(str(run)) if "eval/reward" in r]
    first, last = evals[0], evals[-1]
    assert last["eval/tool_use"] >= first["eval/tool_use"] + 0.3, (first, last)
    assert last["eval/reward"] >= first["eval/reward"] + 0.1, (first, last)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["reward_errors"] == {} and summary["ledger"]["in_flight"] == 0


def test_warmup_transcript_keeps_the_tools_output_out_of_the_loss():
    tok = CharTokenizer()
    task = make_task(TaskConfig(name=NAME, args={"digits": 2}), tok)
    p = task.prompt(0)  # one prompt in four shows a tool episode
    total = str(p.metadata["sum"])
    assert p.answer == (*tok.encode("c"), tok.eos_id, *tok.encode(":" + total), *tok.encode(total), tok.eos_id)
    # the call and the copied answer are trained on; ":" and the tool's digits are not
    assert [t for t, keep in zip(p.answer, p.answer_mask) if not keep] == tok.encode(":" + total)
    assert [t for t, keep in zip(p.answer, p.answer_mask) if keep] == [*tok.encode("c"), tok.eos_id,
                                                                       *tok.encode(total), tok.eos_id]
    direct = task.prompt(1)
    assert direct.answer == (*tok.encode(str(direct.metadata["sum"])), tok.eos_id)
    assert direct.answer_mask == ()  # a direct answer: all of it


def test_supervised_warmup_trains_only_on_the_models_tokens():
    """The warm-up's batches (launch/run/train.py) carry the transcripts' masks: the tool's output is
    in the context, out of the loss."""
    from cadence.actors.prompt_stream import PromptStream
    from cadence.launch.config import load_config
    from cadence.launch.metrics import Progress
    from cadence.launch.run.train import supervised_warmup

    tok = CharTokenizer()
    task = make_task(TaskConfig(name=NAME, args={"digits": 2}), tok)
    cfg = load_config(overrides=["learner.sft.steps=1", "learner.sft.batch_size=4"])
    seen = []

    class Recording:  # records the batch the warm-up builds, then does nothing
        def init(self, params):
            return None

        def update(self, params, opt_state, batch):
            seen.append(batch)
            return params, opt_state, {"loss": 0.0}

    supervised_warmup(cfg, None, {}, PromptStream(task), 32, tok.pad_id, Progress(False), sft=Recording())
    batch, p = seen[0], task.prompt(0)
    n = len(p.tokens)
    row_loss = batch.loss_mask[0, n:n + len(p.answer)]
    assert list(row_loss) == [1.0 if keep else 0.0 for keep in p.answer_mask]
    assert list(batch.tokens[0, n:n + len(p.answer)]) == list(p.answer)  # the tool's output is in the context
