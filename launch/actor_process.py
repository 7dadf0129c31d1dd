"""`cadence actor`: an actor process that joins a running learner, here or on another host.

    cadence actor --connect tcp://HOST:PORT [--keys DIR] [--id NAME]

It says Hello to the learner's dispatcher, builds the task, model and engine from the run's config
that comes back in the Welcome, fetches weights from the learner's weight server when a grant
needs newer ones, and generates until the learner says the run is finished (exit 0). SIGTERM or
SIGINT: it leaves at once with a Goodbye, so its in-flight prompts go back to the stream (exit 0).
If the learner goes away (preempted, restarting), it keeps asking to rejoin and continues with the
resumed learner; weights from before the restart are dropped, since the resumed run may be older.

`--connect -` is how `cadence train actors.processes=N` starts its processes while the learner is
still building: the endpoint, and before it optionally the run's config, arrive as JSON lines on
stdin ({"config": {...}} then {"connect": "tcp://..."}) from the parent. With the config, the
process builds its model and engine and compiles generation before it connects, so that work
overlaps the learner's start instead of delaying the first step; a Welcome with another config
rebuilds.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import socket
import sys
import threading
from typing import Any

import zmq

EXIT_OK, EXIT_FAILED = 0, 1


def default_actor_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def run_actor(endpoint: str, actor_id: str, keys_dir: str = "", stop: threading.Event | None = None,
              log=lambda text: print(f"cadence actor: {text}", file=sys.stderr, flush=True),
              parts: "Parts | None" = None) -> int:
    """Join the learner at `endpoint` and generate until told to stop. parts: built from the run's
    config before connecting (see prepare()); used if the Welcome carries the same config."""
    from protocols.dispatch_client import DispatcherClient
    from protocols.zmq_transport import CurveKeys

    stop = stop or threading.Event()
    keys = CurveKeys.load(keys_dir) if keys_dir else None
    ctx = zmq.Context()
    client = DispatcherClient(endpoint, actor_id, capacity=1, ctx=ctx, keys=keys).start()
    log(f"{actor_id}: connecting to {endpoint}")
    welcome = None
    while welcome is None and not stop.is_set():
        welcome = client.wait_welcome(0.2)
    if welcome is None:
        if parts is not None:
            parts.scorer.close()
        client.close("stopped before joining")
        return EXIT_OK
    try:
        if parts is None or parts.config != welcome.config:
            if parts is not None:
                log(f"{actor_id}: the run's config differs from the one prepared with: building again")
                parts.scorer.close()
            parts = prepare(welcome.config)
        else:
            log(f"{actor_id}: model and engine were prepared before joining")
        actor = _build(parts, welcome, client, actor_id, ctx, keys, log)
    except Exception as e:  # a config this host cannot build (a model path missing here, ...)
        log(f"{actor_id}: cannot build the run's actor here: {type(e).__name__}: {e}")
        client.close(f"{type(e).__name__}: {e}", error=True)
        return EXIT_FAILED
    worker = threading.Thread(target=_work, args=(actor, stop), name=actor_id, daemon=True)
    worker.start()
    session = welcome.session
    while worker.is_alive() and not stop.is_set():
        worker.join(0.2)
        if client.session and client.session != session:  # the learner restarted and took us back
            session = client.session
            log(f"{actor_id}: joined session {session} (the learner restarted)")
        if client.stop_reason:  # the learner said so
            break
    stop.set()
    # The worker finishes its engine call (its groups still count) before the reward workers close
    # under it; a short grace only, since it may wait on a learner that is gone (a weights fetch
    # from a server that just closed never answers).
    worker.join(5.0)
    error = actor.error  # read before closing the reward workers: a step still scoring then fails
    actor.scorer.close()  # its reward workers
    if error is not None and not client.stop_reason:  # the worker already said Goodbye with the error
        log(f"{actor_id}: failed: {type(error).__name__}: {error}")
        return EXIT_FAILED
    reason = client.stop_reason or "stopped"
    client.close(reason)
    log(f"{actor_id}: left ({reason}); {actor.stats.samples} samples sent")
    return EXIT_FAILED if reason.startswith("actor ") else EXIT_OK  # "actor X made no progress ...": hung


def _work(actor, stop) -> None:
    try:
        actor.run(stop)
    except BaseException:  # kept in actor.error, reported by the main thread
        pass


@dataclasses.dataclass
class Parts:
    """What an actor process builds from the run's config alone (no learner needed)."""

    config: dict
    cfg: Any
    policy: Any
    task: Any
    engine: Any
    scorer: Any  # the task's rewards: inline, a worker pool (its processes start here) or HTTP


def prepare(config: dict, warm: bool = False) -> Parts:
    """The task, model template and engine of a run's config; warm: also compile generation."""
    from actors.engine import JaxEngine
    from actors.rewards import make_scorer
    from actors.tasks.registry import make_task
    from launch import compile_cache, config_loader
    from launch.config import Config
    from launch.policy import policy_skeleton

    cfg = config_loader.merge(Config(), config)
    config_loader.validate_tree(cfg)
    compile_cache.enable(cfg.run.jax_cache)  # this host's cache: a restarted actor loads its programs
    policy = policy_skeleton(cfg)  # shapes and tokenizer; the weights come from the learner
    task = make_task(cfg.task, policy.tokenizer)
    engine = JaxEngine(policy.model_cfg, policy.graphdef, cfg.engine, policy.tokenizer.eos_id,
                       policy.tokenizer.pad_id)
    if warm:  # one call as the actor loop makes it (zero weights): its programs get compiled now
        import jax
        import numpy as np

        from actors.episodes import generate_rollouts

        zeros = jax.device_put(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), policy.params))
        rows = [task.prompt(i) for i in range(cfg.actors.prompts_per_call) for _ in range(cfg.learner.group_size)]
        generate_rollouts(engine, zeros, task, rows, jax.random.fold_in(jax.random.key(cfg.actors.seed), 0))
    return Parts(config, cfg, policy, task, engine, make_scorer(cfg.task, task, policy.tokenizer))


def _build(parts: Parts, welcome, client, actor_id, ctx, keys, log):
    from actors.actor_loop import Actor
    from actors.remote_weights import RemoteWeights
    from protocols.weights_wire import WeightClient

    cfg, policy, task = parts.cfg, parts.policy, parts.task
    client.heartbeat_seconds = cfg.actors.heartbeat_seconds
    client.learner_timeout_seconds = cfg.actors.heartbeat_timeout_seconds
    weights = RemoteWeights(lambda endpoint: WeightClient(endpoint, ctx=ctx, keys=keys), policy.params,
                            endpoint_fn=lambda: client.welcome.weights_endpoint)
    log(f"{actor_id}: joined session {welcome.session} (task {task.name}, {cfg.learner.group_size} completions "
        f"per prompt, {welcome.concurrency} prompts per call)")
    return Actor(actor_id, parts.engine, task, client, weights, cfg.learner.group_size, welcome.concurrency,
                 cfg.actors.seed, scorer=parts.scorer)


def _from_parent(stop: threading.Event, log) -> tuple[str, Parts | None] | None:
    """`--connect -`: read the config (optional) and the endpoint from stdin, building meanwhile."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)  # EOF: the parent is gone or closed the pipe

    threading.Thread(target=read, name="stdin", daemon=True).start()
    parts = None
    while not stop.is_set():
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if line is None:
            log("stdin closed before an endpoint arrived")
            break
        msg = json.loads(line)
        if "config" in msg:
            try:
                parts = prepare(msg["config"], warm=True)
            except Exception as e:  # built again (and reported) when the Welcome brings the config
                log(f"could not prepare from the parent's config: {type(e).__name__}: {e}")
        if "connect" in msg:
            return msg["connect"], parts
    if parts is not None:
        parts.scorer.close()
    return None


def main(endpoint: str, actor_id: str, keys_dir: str) -> int:
    stop = threading.Event()

    def handle(signum, frame):
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
    parts = None
    if endpoint == "-":
        got = _from_parent(stop, lambda text: print(f"cadence actor: {actor_id}: {text}", file=sys.stderr,
                                                     flush=True))
        if got is None:
            return EXIT_OK
        endpoint, parts = got
    return run_actor(endpoint, actor_id, keys_dir, stop, parts=parts)
