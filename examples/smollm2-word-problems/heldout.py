"""Greedy held-out accuracy of a checkpoint (or of a finished run) on the word problems, by op count,
with a few completions to read.

    python examples/smollm2-word-problems/heldout.py --config examples/smollm2-word-problems/config.yaml
    python examples/smollm2-word-problems/heldout.py --run runs/NAME        # the run's trained params
    ... [--limit N] [--show K] [key=value overrides]

Generation and scoring are the held-out evaluation's own (actors/evaluation.py: one greedy engine
call, the task's score); this adds the breakdown and the texts. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # noqa: E402

from cadence.actors.engine import JaxEngine  # noqa: E402
from cadence.actors.episodes import generate_rollouts  # noqa: E402
from cadence.actors.rewards.scoring import InlineScorer, score_rollouts  # noqa: E402
from cadence.actors.tasks.base import completion_text  # noqa: E402
from cadence.actors.tasks.registry import make_task  # noqa: E402
from cadence.launch import artifacts  # noqa: E402
from cadence.launch.config import load_config  # noqa: E402
from cadence.learner.models.policy import build_policy  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=[], help="config file (repeatable)")
    ap.add_argument("--run", default="", help="a run directory: its config.yaml and trained params")
    ap.add_argument("--limit", type=int, default=0, help="only the first N held-out problems")
    ap.add_argument("--show", type=int, default=4, help="completions to print")
    args, overrides = ap.parse_known_args(argv)
    files = [os.path.join(args.run, "config.yaml")] if args.run else args.config
    cfg = load_config(files, overrides)
    policy = build_policy(cfg)
    params = artifacts.load_params(args.run, policy.params) if args.run else policy.params
    tok = policy.tokenizer
    engine = JaxEngine(policy.model_cfg, policy.graphdef, cfg.engine, tok.eos_id, tok.pad_id)
    task = make_task(cfg.task, tok)
    prompts = task.heldout()[: args.limit or None]
    start = time.perf_counter()
    out = generate_rollouts(engine, params, task, prompts, jax.random.key(0), greedy=True)
    generate_s = time.perf_counter() - start
    start = time.perf_counter()
    scores = [g[0] for g in score_rollouts(InlineScorer(task), task, prompts, out)]
    score_s = time.perf_counter() - start
    by_ops: dict[int, list[float]] = collections.defaultdict(list)
    for p, s in zip(prompts, scores):
        by_ops[p.metadata["ops"]].append(s.reward)
    lengths = [len(t) for t in out.tokens]
    result = {
        "checkpoint": cfg.model.path, "run": args.run, "n": len(prompts),
        "accuracy": sum(s.reward for s in scores) / len(scores),
        "accuracy_by_ops": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_ops.items())},
        "n_by_ops": {k: len(v) for k, v in sorted(by_ops.items())},
        "formatted": sum(s.metrics["formatted"] for s in scores) / len(scores),
        "ended_with_eos": sum(1 for t in out.tokens if t and t[-1] == tok.eos_id) / len(prompts),
        "mean_completion_tokens": sum(lengths) / len(lengths), "max_new_tokens": cfg.engine.max_new_tokens,
        "generate_s": round(generate_s, 1), "score_s": round(score_s, 3),  # inline: the verifier alone
        "samples": [{"problem": p.text, "answer": p.metadata["answer"], "reward": s.reward,
                     "completion": completion_text(tok, t)}
                    for p, s, t in list(zip(prompts, scores, out.tokens))[: args.show]],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
