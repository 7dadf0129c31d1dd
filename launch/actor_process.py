"""`cadence actor`: an actor process that joins a running learner, here or on another host.

    cadence actor --connect tcp://HOST:PORT [--keys DIR] [--id NAME]

It says Hello to the learner's dispatcher, builds the task, model and engine from the run's config
that comes back in the Welcome, fetches weights from the learner's weight server when a grant
needs newer ones, and generates until the learner says the run is finished (exit 0). SIGTERM or
SIGINT: it leaves at once with a Goodbye, so its in-flight prompts go back to the stream (exit 0).
If the learner goes away (preempted, restarting), it keeps asking to rejoin and continues with the
resumed learner; weights from before the restart are dropped, since the resumed run may be older.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading

import zmq

EXIT_OK, EXIT_FAILED = 0, 1


def default_actor_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def run_actor(endpoint: str, actor_id: str, keys_dir: str = "", stop: threading.Event | None = None,
              log=lambda text: print(f"cadence actor: {text}", file=sys.stderr, flush=True)) -> int:
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
        client.close("stopped before joining")
        return EXIT_OK
    try:
        actor = _build(welcome, client, actor_id, ctx, keys, log)
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


def _build(welcome, client, actor_id, ctx, keys, log):
    from actors.actor_loop import Actor
    from actors.engine import JaxEngine
    from actors.remote_weights import RemoteWeights
    from actors.rewards import make_scorer
    from actors.tasks.registry import make_task
    from launch import compile_cache, config_loader
    from launch.config import Config
    from launch.policy import build_policy
    from protocols.weights_wire import WeightClient

    cfg = config_loader.merge(Config(), welcome.config)
    config_loader.validate_tree(cfg)
    compile_cache.enable(cfg.run.jax_cache)  # this host's cache: a restarted actor loads its programs
    client.heartbeat_seconds = cfg.actors.heartbeat_seconds
    client.learner_timeout_seconds = cfg.actors.heartbeat_timeout_seconds
    policy = build_policy(cfg)  # the model's shape and tokenizer; its weights come from the learner
    task = make_task(cfg.task, policy.tokenizer)
    engine = JaxEngine(policy.model_cfg, policy.graphdef, cfg.engine, policy.tokenizer.eos_id,
                       policy.tokenizer.pad_id)
    weights = RemoteWeights(lambda endpoint: WeightClient(endpoint, ctx=ctx, keys=keys), policy.params,
                            endpoint_fn=lambda: client.welcome.weights_endpoint)
    log(f"{actor_id}: joined session {welcome.session} (task {task.name}, {cfg.learner.group_size} completions "
        f"per prompt, {welcome.concurrency} prompts per call)")
    return Actor(actor_id, engine, task, client, weights, cfg.learner.group_size, welcome.concurrency,
                 cfg.actors.seed, scorer=make_scorer(cfg.task, task, policy.tokenizer))


def main(endpoint: str, actor_id: str, keys_dir: str) -> int:
    stop = threading.Event()

    def handle(signum, frame):
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
    return run_actor(endpoint, actor_id, keys_dir, stop)
