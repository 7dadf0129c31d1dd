"""`cadence` command line.

    cadence train [--config FILE ...] [key=value ...]   train (defaults learn on a laptop CPU)
    cadence train --print-config [key=value ...]        show the resolved config and exit
    cadence eval RUN_DIR                                greedy held-out evaluation of a finished run

A bad key, type or value exits with status 2 and a message naming the key.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cadence", description="Asynchronous RL for language models on JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy (GRPO) on a verifiable task")
    t.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config file (repeatable; later files win)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    t.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. learner.optimizer.lr=1e-3 run.steps=50")
    e = sub.add_parser("eval", help="greedy held-out evaluation of a run directory")
    e.add_argument("run_dir")
    return p


def _fail(msg: str, code: int) -> int:
    print(f"cadence: {msg}", file=sys.stderr)
    return code


def cmd_train(args) -> int:
    from launch.config import load_config
    from launch.config_loader import ConfigError, to_dict

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return _fail(f"config error: {e}", EXIT_CONFIG)
    if args.print_config:
        yaml.safe_dump(to_dict(cfg), sys.stdout, sort_keys=False)
        return 0
    from launch.train import train

    try:
        summary = train(cfg)
    except FileExistsError as e:
        return _fail(str(e), EXIT_CONFIG)
    print(json.dumps(summary))
    return 0


def cmd_eval(args) -> int:
    from launch.config import load_config
    from launch.config_loader import ConfigError

    cfg_path = os.path.join(args.run_dir, "config.yaml")
    if not os.path.isfile(cfg_path):
        return _fail(f"{cfg_path} not found: {args.run_dir} is not a Cadence run directory", 1)
    try:
        cfg = load_config([cfg_path])
    except ConfigError as e:
        return _fail(f"config error in {cfg_path}: {e}", EXIT_CONFIG)
    from actors.engine import JaxEngine
    from actors.tasks.base import make_task
    from launch import artifacts
    from launch.train import evaluate
    from learner.models.char_tokenizer import CharTokenizer
    from learner.models.llama import init_params

    graphdef, template = init_params(cfg.model, cfg.learner.seed)
    try:
        params = artifacts.load_params(args.run_dir, template)
    except FileNotFoundError as e:
        return _fail(str(e), 1)
    tok = CharTokenizer()
    engine = JaxEngine(cfg.model, graphdef, cfg.engine, tok.eos_id, tok.pad_id)
    task = make_task(cfg.task)
    result = {"run_dir": os.path.abspath(args.run_dir), "task": task.name,
              "heldout_size": len(task.heldout()), **evaluate(engine, task, params)}
    print(json.dumps(result))
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "train":
        return cmd_train(args)
    return cmd_eval(args)


if __name__ == "__main__":
    sys.exit(main())
