"""`cadence` command line.

    cadence train [--config FILE ...] [key=value ...]   train (defaults learn on a laptop CPU)
    cadence train --resume run.dir=DIR [key=value ...]  continue DIR from its newest checkpoint
    cadence train --print-config [key=value ...]        show the resolved config and exit
    cadence eval RUN_DIR                                greedy held-out evaluation of a finished run
    cadence experiment NAME [--quick] [key=value ...]   batch-invariance | throughput | decision-rule
    cadence actor --connect ENDPOINT [--keys DIR]       join a running learner as an actor process
          [--sglang-url URL ...] [--work-dir DIR]       (engine=sglang: attach to servers, or launch them here)
    cadence keys DIR                                    write CurveZMQ keys (actors.keys_dir=DIR)
    cadence status RUN_DIR [--watch] [--json]           is the run healthy? (one screen)
    cadence report RUN_DIR [RUN_DIR ...] [--out FILE]   one self-contained HTML file of plots
    cadence replay RUN_DIR [key=value ...]              the controller's decisions on a run's logged updates
    cadence launch ray [--address ADDR] [--config FILE ...] [key=value ...]   the run on a Ray cluster
    cadence launch slurm [--sbatch ARG ...] [--config FILE ...] [key=value ...]  the run as a SLURM job
    cadence launch KIND --status RUN_DIR | --stop RUN_DIR                     its processes; a clean stop

Exit status: 0 done (also after SIGTERM/SIGINT with a final checkpoint), 1 runtime failure,
2 bad config (the message names the key), 3 nothing to do (the run already finished).
`cadence status` exits with the run's state: 0 running, 4 finished, 5 preempted (SIGTERM/SIGINT
with a final checkpoint; resume it), 6 dead (killed, crashed, or its heartbeat went stale),
7 stalled (alive, but no update for run.stall_factor times its recent update time), and 1 when
RUN_DIR is not a run directory.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import yaml

EXIT_CONFIG = 2
EXIT_FINISHED = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cadence", description="Asynchronous RL for language models on JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy (GRPO) on a verifiable task")
    t.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config file (repeatable; later files win)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    t.add_argument("--resume", action="store_true",
                   help="continue run.dir from its newest complete checkpoint (same as run.resume=yes); "
                        "the run's saved config is the base, overrides apply on top")
    t.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. learner.optimizer.lr=1e-3 run.steps=50")
    e = sub.add_parser("eval", help="greedy held-out evaluation of a run directory")
    e.add_argument("run_dir")
    x = sub.add_parser("experiment", help="run an experiment (batch-invariance, throughput, decision-rule)")
    x.add_argument("name", choices=["batch-invariance", "throughput", "decision-rule"])
    x.add_argument("--quick", action="store_true", help="the CI size: minutes on a 2-core CPU")
    x.add_argument("--out", default=None, help="experiment folder (default experiments/NAME-<UTC time>)")
    x.add_argument("--config", action="append", default=[], metavar="FILE", help="base YAML config (repeatable)")
    x.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="fixed batch sizes to compare")
    x.add_argument("--scalings", nargs="+", choices=["sqrt", "linear", "none"], default=None)
    x.add_argument("--seeds", type=int, nargs="+", default=None)
    x.add_argument("--max-samples", type=int, default=None, help="sample budget per run")
    x.add_argument("--eval-samples", type=int, default=None, help="held-out evaluation every this many samples")
    x.add_argument("--target", default=None, help="target score, or 'auto'")
    x.add_argument("--metric", default=None, choices=["eval/reward", "eval/exact_match"])
    x.add_argument("--concurrencies", type=int, nargs="+", default=None, help="throughput: prompts per call")
    x.add_argument("--pipeline-batch-sizes", type=int, nargs="+", default=None,
                   help="throughput: also time the whole pipeline X(B) with a short real run per batch size")
    x.add_argument("--pipeline-updates", type=int, default=None,
                   help="throughput: updates of each pipeline run (update 1 compiles, the rest are timed)")
    x.add_argument("--controller-start", default=None, choices=["smallest", "middle"],
                   help="decision-rule: the batch size the controller run starts at (default middle)")
    x.add_argument("--window", type=int, default=None, help="decision-rule: the controller's window (updates)")
    x.add_argument("--dwell", type=int, default=None, help="decision-rule: the controller's dwell (updates)")
    x.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the base training config")
    a = sub.add_parser("actor", help="join a running learner as an actor process (this host or another)")
    a.add_argument("--connect", required=True, metavar="ENDPOINT",
                   help="the learner's dispatcher (RUN_DIR/endpoint.json has it): by default "
                   "ipc://RUN_DIR/sockets/dispatch (this host, this user), or e.g. tcp://10.0.0.5:5555; "
                   "'-': read it (and optionally the run's config first) as JSON lines on stdin")
    a.add_argument("--keys", default="", metavar="DIR", help="CurveZMQ keys (server.key, client.key, "
                   "client.key_secret) when the learner listens with actors.keys_dir")
    a.add_argument("--id", default="", help="actor name, unique among the run's actors (default HOST-PID)")
    a.add_argument("--sglang-url", action="append", default=[], metavar="URL",
                   help="actors.engine=sglang: drive this running SGLang server instead of launching servers "
                        "here (repeatable; weight sync 'disk')")
    a.add_argument("--work-dir", default="", metavar="DIR",
                   help="actors.engine=sglang: exported weights and server logs (default: a temporary directory)")
    k = sub.add_parser("keys", help="write a CurveZMQ key set for actors.keys_dir")
    k.add_argument("dir")
    s = sub.add_parser("status", help="state, progress, throughput and ETA of a run (exit code = state)")
    s.add_argument("run_dir")
    s.add_argument("--watch", action="store_true", help="refresh until the run stops running (Ctrl-C to leave)")
    s.add_argument("--interval", type=float, default=2.0, help="--watch refresh period, seconds")
    s.add_argument("--json", action="store_true", help="print the status as one JSON object")
    rp = sub.add_parser("replay", help="the batch-size controller's decisions on a finished run's logged updates "
                                       "(controller.* overrides: what other settings would have decided)")
    rp.add_argument("run_dir")
    rp.add_argument("overrides", nargs="*", help="key=value settings over the run's config")
    r = sub.add_parser("report", help="an HTML report with plots comparing runs (no network needed to view)")
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    r.add_argument("--out", default=None, help="output file (default RUN_DIR/report.html, or ./report.html for several)")
    lr = sub.add_parser("launch", help="run on a cluster: `cadence launch ray` (pip install 'cadence-rl[ray]') "
                        "or `cadence launch slurm`")
    kinds = lr.add_subparsers(dest="kind", required=True, metavar="KIND")
    from cadence.launch.cluster import launcher

    for kind in launcher.kinds():
        impl = launcher.get(kind)  # a launcher module imports its cluster library only when it runs
        k = kinds.add_parser(kind, help=impl.help)
        impl.add_arguments(k)
        k.add_argument("--config", action="append", default=[], metavar="FILE", help="YAML config file (repeatable)")
        k.add_argument("--status", metavar="RUN_DIR", help="print the launched run's processes, nodes, restarts, "
                       "step and samples")
        k.add_argument("--stop", metavar="RUN_DIR", help="stop the launched run cleanly (final checkpoint)")
        k.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as for train")
    return p


def _fail(msg: str, code: int) -> int:
    print(f"cadence: {msg}", file=sys.stderr)
    return code


def cmd_train(args) -> int:
    from cadence.launch.config import load_config
    from cadence.launch.config_loader import ConfigError, to_dict

    notes: list[str] = []
    try:
        cfg = load_config(args.config, args.overrides, notes)
        resume = "yes" if args.resume else cfg.run.resume
        saved = os.path.join(cfg.run.dir, "config.yaml") if cfg.run.dir else ""
        if resume != "no" and saved and os.path.isfile(saved):
            # the run's own config is the base, so `--resume run.dir=DIR` needs nothing else
            notes = []
            cfg = load_config([saved, *args.config], args.overrides, notes)
        if args.resume and not cfg.run.dir:
            raise ConfigError("run.dir: --resume needs the run directory, e.g. run.dir=runs/NAME")
    except ConfigError as e:
        return _fail(f"config error: {e}", EXIT_CONFIG)
    for note in notes:
        print(f"cadence: note: {note}", file=sys.stderr)
    if args.print_config:
        yaml.safe_dump(to_dict(cfg), sys.stdout, sort_keys=False)
        return 0
    if cfg.learner.processes > 1 and "CADENCE_PROCESS_ID" not in os.environ:  # [sharded learner]
        from cadence.launch import artifacts
        from cadence.launch.cluster.learner_group import run_local_group
        from cadence.launch.config import preflight

        try:
            preflight(cfg)  # once here, so a bad task or model exits 2 before N processes start
        except ConfigError as e:
            return _fail(f"config error: {e}", EXIT_CONFIG)

        train_args = [a for f in args.config for a in ("--config", f)] + ["--resume"] * args.resume
        run_dir = os.path.abspath(cfg.run.dir or artifacts.default_run_dir(cfg))
        return run_local_group(train_args + list(args.overrides), cfg.learner.processes, run_dir)
    from cadence.launch.run.run_state import RunFinished
    from cadence.launch.run.train import train
    from cadence.learner.checkpoint import CheckpointError

    try:
        summary = train(cfg, resume=resume)
    except ConfigError as e:
        return _fail(f"config error: {e}", EXIT_CONFIG)
    except FileExistsError as e:
        return _fail(str(e), EXIT_CONFIG)
    except RunFinished as e:
        return _fail(str(e), EXIT_FINISHED)
    except CheckpointError as e:
        return _fail(f"checkpoint error: {e}", 1)
    print(json.dumps(summary))
    return 0


def cmd_eval(args) -> int:
    from cadence.launch.config import load_config
    from cadence.launch.config_loader import ConfigError

    cfg_path = os.path.join(args.run_dir, "config.yaml")
    if not os.path.isfile(cfg_path):
        return _fail(f"{cfg_path} not found: {args.run_dir} is not a Cadence run directory", 1)
    try:
        cfg = load_config([cfg_path])
    except ConfigError as e:
        return _fail(f"config error in {cfg_path}: {e}", EXIT_CONFIG)
    from cadence.launch.evaluate import evaluate

    try:
        held = evaluate(cfg, args.run_dir)
    except FileNotFoundError as e:
        return _fail(str(e), 1)
    result = {"run_dir": os.path.abspath(args.run_dir), "task": held.task, "heldout_size": len(held.prompts),
              **held.metrics}
    print(json.dumps(result))
    return 0


def cmd_experiment(args) -> int:
    from cadence.launch.config import load_config
    from cadence.launch import config_loader
    from cadence.launch.experiments import batch_invariance, run_experiment

    size = batch_invariance.QUICK if args.quick else batch_invariance.FULL
    # the experiment's own base settings (smaller warm-up / larger held-out set): for the keys the
    # user's files and overrides leave unset (a --config's task.heldout_size: 64 must not become 2048)
    notes: list[str] = []
    try:
        given = config_loader.given_keys(list(args.config), list(args.overrides))
        extra = [o for o in (size["overrides"] if args.name != "throughput" else ())
                 if o.split("=", 1)[0] not in given]
        cfg = load_config(args.config, extra + list(args.overrides), notes)
    except config_loader.ConfigError as e:
        return _fail(f"config error: {e}", EXIT_CONFIG)
    for note in notes:
        print(f"cadence: note: {note}", file=sys.stderr)
    opts = {"batch_sizes": tuple(args.batch_sizes) if args.batch_sizes else None,
            "scalings": tuple(args.scalings) if args.scalings else None,
            "seeds": tuple(args.seeds) if args.seeds else None, "max_samples": args.max_samples,
            "eval_samples": args.eval_samples, "target": args.target, "metric": args.metric,
            "concurrencies": tuple(args.concurrencies) if args.concurrencies else None,
            "pipeline_batch_sizes": tuple(args.pipeline_batch_sizes) if args.pipeline_batch_sizes else None,
            "pipeline_updates": args.pipeline_updates, "controller_start": args.controller_start,
            "window": args.window, "dwell": args.dwell}
    try:
        results = run_experiment(args.name, cfg, args.out, args.quick,
                                 log=lambda msg: print(msg, file=sys.stderr, flush=True), **opts)
    except (FileExistsError, ValueError) as e:
        return _fail(str(e), EXIT_CONFIG)
    print(json.dumps({"experiment": args.name, "out": results["out"]}))
    return 0


def cmd_launch(args) -> int:
    from cadence.launch.cluster import launcher

    impl = launcher.get(args.kind)
    if args.status or args.stop:
        try:
            if args.status:
                print(json.dumps(impl.status(args.status), indent=1))
            else:
                print(json.dumps({"stop_requested": impl.stop(args.stop)}))
        except FileNotFoundError as e:
            return _fail(str(e), 1)
        return 0
    from cadence.launch import artifacts
    from cadence.launch.config import load_config, preflight
    from cadence.launch.config_loader import ConfigError

    try:
        cfg = load_config(args.config, args.overrides)
        impl.check_config(cfg)
        preflight(cfg)  # the checks that build the task and load the tokenizer: exit 2 here, not on a node
    except ConfigError as e:
        return _fail(f"config error: {e}", EXIT_CONFIG)
    run_dir = os.path.abspath(cfg.run.dir or artifacts.default_run_dir(cfg))
    try:
        return impl.from_args(cfg, run_dir, args).run()
    except launcher.LauncherUnavailable as e:
        return _fail(str(e), 1)


def cmd_keys(args) -> int:
    from cadence.protocols.zmq_transport import SecurityError, write_keys

    try:
        keys = write_keys(args.dir)
    except SecurityError as e:
        return _fail(str(e), EXIT_CONFIG)
    print(json.dumps({"keys_dir": keys.directory, "learner": "actors.keys_dir=" + keys.directory,
                      "actor_hosts_need": ["server.key", "client.key", "client.key_secret"]}))
    return 0


def cmd_status(args) -> int:
    from rich.console import Console

    from cadence.launch.observe import status

    try:
        st = status.run_status(args.run_dir)
    except status.NotARun as e:
        return _fail(str(e), status.EXIT_NOT_A_RUN)
    if args.json:
        print(json.dumps(st))
    elif args.watch:
        st = status.watch(args.run_dir, args.interval, Console())
    else:
        Console().print(status.render(st))
    return status.EXIT_CODES[st["state"]]


def cmd_replay(args) -> int:
    from cadence.launch.config_loader import ConfigError
    from cadence.launch.experiments.replay import replay

    try:
        out = replay(args.run_dir, args.overrides)
    except FileNotFoundError as e:
        return _fail(str(e), 1)
    except (ConfigError, ValueError) as e:
        return _fail(f"config error: {e}", EXIT_CONFIG)
    for d in out["decisions"]:  # one JSON line per decision, then the summary
        print(json.dumps({k: d.get(k) for k in ("step", "batch_size", "action", "new_batch_size",
                                                "noise_scale", "noise_scale_interval", "reason")}))
    print(json.dumps({"run_dir": out["run_dir"], "decisions": len(out["decisions"]),
                      "stopped_at": out["stopped_at"], "why": out["why"]}))
    return 0


def cmd_report(args) -> int:
    from cadence.launch.observe.report import write_report
    from cadence.launch.observe.status import NotARun

    try:
        path = write_report(args.run_dirs, args.out)
    except NotARun as e:
        return _fail(str(e), 1)
    except ImportError as e:  # matplotlib missing
        return _fail(str(e), 1)
    print(json.dumps({"report": path}))
    return 0


_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")
_ONE_VALUE = {"--out", "--config", "--max-samples", "--eval-samples", "--target", "--metric", "--controller-start",
              "--window", "--dwell"}


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate dotted `key=value` overrides from the options, wherever they stand.

    argparse alone lets a list option (`--seeds 0 1`) swallow an override after it and fail on
    it; taking them out first lets a user append overrides to any command line. A token that is
    the value of a one-value option (`--out runs/a=b`) stays with its option.
    """
    rest, overrides = [], []
    for i, tok in enumerate(argv):
        if _OVERRIDE.match(tok) and not (i and argv[i - 1] in _ONE_VALUE):
            overrides.append(tok)
        else:
            rest.append(tok)
    return rest, overrides


def main(argv=None) -> int:
    parser = _parser()
    rest, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(rest)
    if hasattr(args, "overrides"):
        args.overrides = list(args.overrides) + overrides
    elif overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    if args.command in ("train", "experiment", "actor", "eval"):
        from cadence.launch.host_memory import fix_mmap_threshold

        fix_mmap_threshold()  # before JAX allocates: freed activation buffers go back to the OS
    if args.command == "train":
        return cmd_train(args)
    if args.command == "experiment":
        return cmd_experiment(args)
    if args.command == "actor":
        from cadence.launch.cluster.actor_process import default_actor_id, main as actor_main

        bad = [u for u in args.sglang_url if not u.startswith(("http://", "https://"))]
        if bad:
            return _fail(f"--sglang-url: must start with http:// or https://, got {bad[0]!r}", EXIT_CONFIG)
        return actor_main(args.connect, args.id or default_actor_id(), args.keys, tuple(args.sglang_url),
                          args.work_dir)
    if args.command == "keys":
        return cmd_keys(args)
    if args.command == "status":
        return cmd_status(args)
    if args.command == "report":
        return cmd_report(args)
    if args.command == "replay":
        return cmd_replay(args)
    if args.command == "launch":
        return cmd_launch(args)
    return cmd_eval(args)


if __name__ == "__main__":
    sys.exit(main())
