"""Greedy held-out accuracy of a checkpoint (or of a finished run) on the word problems, by op count,
with a few completions to read.

    python examples/smollm2-word-problems/heldout.py --config examples/smollm2-word-problems/config.yaml
    python examples/smollm2-word-problems/heldout.py --run runs/NAME        # the run's trained params
    ... [--limit N] [--show K] [key=value overrides]

Generation and scoring are the held-out evaluation's own (`cadence.evaluate`: one greedy engine
call, the task's score); this adds the breakdown and the texts. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # run from a checkout

import cadence  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=[], help="config file (repeatable)")
    ap.add_argument("--run", default="", help="a run directory: its config.yaml and trained params")
    ap.add_argument("--limit", type=int, default=0, help="only the first N held-out problems")
    ap.add_argument("--show", type=int, default=4, help="completions to print")
    args, overrides = ap.parse_known_args(argv)
    files = [os.path.join(args.run, "config.yaml")] if args.run else args.config
    cfg = cadence.load_config(files, overrides)
    start = time.perf_counter()
    held = cadence.evaluate(cfg, args.run or None, limit=args.limit or None)
    seconds = time.perf_counter() - start
    prompts, scores, completions = held.prompts, held.scores, held.completions
    by_ops: dict[int, list[float]] = collections.defaultdict(list)
    for p, s in zip(prompts, scores):
        by_ops[p.metadata["ops"]].append(s.reward)
    lengths = [len(c.ids) for c in completions]
    result = {
        "checkpoint": cfg.model.path, "run": args.run, "n": len(prompts),
        "accuracy": sum(s.reward for s in scores) / len(scores),
        "accuracy_by_ops": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_ops.items())},
        "n_by_ops": {k: len(v) for k, v in sorted(by_ops.items())},
        "formatted": sum(s.metrics["formatted"] for s in scores) / len(scores),
        "stopped_early": sum(1 for c in completions if len(c.ids) < cfg.engine.max_new_tokens) / len(prompts),
        "mean_completion_tokens": sum(lengths) / len(lengths), "max_new_tokens": cfg.engine.max_new_tokens,
        "seconds": round(seconds, 1),  # model load, generation and scoring
        "samples": [{"problem": p.text, "answer": p.metadata["answer"], "reward": s.reward,
                     "completion": c.text}
                    for p, s, c in list(zip(prompts, scores, completions))[: args.show]],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
