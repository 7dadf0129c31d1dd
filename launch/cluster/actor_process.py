"""`cadence actor`: an actor process that joins a running learner, here or on another host.

    cadence actor --connect tcp://HOST:PORT [--keys DIR] [--id NAME] [--sglang-url URL ...] [--work-dir DIR]

It says Hello to the learner's dispatcher, builds the task, model and engine from the run's config
that comes back in the Welcome, fetches weights from the learner's weight server when a grant
needs newer ones, and generates until the learner says the run is finished (exit 0). SIGTERM or
SIGINT: it leaves at once with a Goodbye, so its in-flight prompts go back to the stream (exit 0).
If the learner goes away (preempted, restarting), it keeps asking to rejoin and continues with the
resumed learner; weights from before the restart are dropped, since the resumed run may be older.

With actors.engine=sglang the process drives SGLang servers of its own: it launches them on this
host (actors.sglang.launch_python or $CADENCE_SGLANG_PYTHON here, free ports, files in --work-dir),
or attaches to servers someone else runs (--sglang-url, repeatable; weight sync 'disk' then). It
fetches weights from the learner like any actor process, and its engine's sync_weights brings its
servers to them (restart, disk or distributed, as actors.sglang.sync says). Before asking for work
it starts its servers on the newest weights, so no prompt waits on a server start. Launched servers
die with the process, even on `kill -9` (actors/sglang/server.py die_with_parent).

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
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from typing import TYPE_CHECKING, Any

import zmq

if TYPE_CHECKING:
    from cadence.actors.engine_api import Engine

EXIT_OK, EXIT_FAILED = 0, 1


def default_actor_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def run_actor(endpoint: str, actor_id: str, keys_dir: str = "", stop: threading.Event | None = None,
              log=lambda text: print(f"cadence actor: {text}", file=sys.stderr, flush=True), *,
              sglang_urls: tuple[str, ...] = (), work_dir: str = "", parts: "Parts | None" = None) -> int:
    """Join the learner at `endpoint` and generate until told to stop. parts: built from the run's
    config before connecting (see prepare()); used if the Welcome carries the same config."""
    from cadence.protocols.dispatch_client import DispatcherClient
    from cadence.protocols.zmq_transport import CurveKeys

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
    local = _LocalFiles(work_dir)
    try:
        if parts is None or parts.config != welcome.config:
            if parts is not None:
                log(f"{actor_id}: the run's config differs from the one prepared with: building again")
                parts.scorer.close()
            parts = prepare(welcome.config, sglang_urls=tuple(sglang_urls),
                            log=lambda text: log(f"{actor_id}: {text}"))
        else:
            log(f"{actor_id}: model and engine were prepared before joining")
        actor = _build(parts, welcome, client, actor_id, ctx, keys, log, sglang_urls, local)
    except Exception as e:  # a config this host cannot build (a model path missing here, ...)
        log(f"{actor_id}: cannot build the run's actor here: {type(e).__name__}: {e}")
        client.close(f"{type(e).__name__}: {e}", error=True)
        local.cleanup()
        return EXIT_FAILED
    try:
        return _serve(actor, client, welcome, stop, actor_id, log)
    finally:
        _close_engine(actor.engine, actor_id, log)
        local.cleanup()


def _close_engine(engine: Engine, actor_id, log) -> None:
    """Requests still running are cut short first (SGLang: else a failing one would restart its
    server), then what the engine owns is freed (the servers it launched)."""
    try:
        engine.abort()
    except Exception as e:  # noqa: BLE001 - best effort; close() stops the servers regardless
        log(f"{actor_id}: abort before closing the {engine.name} engine: {type(e).__name__}: {e}")
    engine.close()


def _serve(actor, client, welcome, stop, actor_id, log) -> int:
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
        actor.run(stop, warm_up=True)
    except BaseException:  # kept in actor.error, reported by the main thread
        pass


class _LocalFiles:
    """Where this actor keeps its SGLang files: --work-dir, else a temporary directory removed at exit."""

    def __init__(self, work_dir: str):
        self.path, self._temporary = work_dir, False

    def get(self, actor_id: str, configured: str) -> str:
        if not self.path:
            if configured:  # actors.sglang.work_dir, one folder per actor
                self.path = os.path.join(configured, actor_id)
            else:
                self.path, self._temporary = tempfile.mkdtemp(prefix=f"cadence-{actor_id}-"), True
        # Checkpoints a killed predecessor of this actor exported (a model's size each): its
        # servers are gone, and this process exports its own. The compilation cache stays.
        if os.path.isdir(self.path):
            for name in os.listdir(self.path):
                if re.fullmatch(r"v\d{6}", name):
                    shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
        return self.path

    def cleanup(self) -> None:
        if self._temporary:
            shutil.rmtree(self.path, ignore_errors=True)


def local_sglang(cfg, sglang_urls: tuple[str, ...], log=lambda text: None):
    """The run's config as this one actor process sees it: its own servers (sglang_urls, or none
    to launch), one actor; attached servers get sync 'disk' where the run says 'restart'.

    Raises ValueError (naming the key or option) when this host cannot drive SGLang servers.
    """
    from cadence.actors.sglang.weight_sync import weight_sync_method

    sg = dataclasses.replace(cfg.actors.sglang, urls=tuple(sglang_urls))
    sg = weight_sync_method(sg.sync).for_actor_process(sg, log)  # e.g. restart -> disk for attached servers
    if not sglang_urls and not sg.resolved_python():
        raise ValueError("actors.sglang.launch_python: this host has no SGLang python to launch servers with; "
                         "set $CADENCE_SGLANG_PYTHON here, or attach running servers with --sglang-url URL")
    actors = dataclasses.replace(cfg.actors, processes=0, num_actors=1, sglang=sg)
    # where evaluation runs is the learner's choice (an EvalGrant says it); this one-actor view has
    # no actor processes, so run.eval_on=actors would not validate here
    return dataclasses.replace(cfg, actors=actors, run=dataclasses.replace(cfg.run, eval_on="auto"))


@dataclasses.dataclass
class Parts:
    """What an actor process builds from the run's config alone (no learner needed)."""

    config: dict
    cfg: Any
    policy: Any
    task: Any
    engine: Any  # the built-in engine (None with engine=sglang: its servers are built in _build)
    scorer: Any  # the task's rewards: inline, a worker pool (its processes start here) or HTTP


def prepare(config: dict, warm: bool = False, sglang_urls: tuple[str, ...] = (), log=lambda text: None) -> Parts:
    """The task, model skeleton and engine of a run's config as this process sees it (its own
    SGLang servers: local_sglang); warm: also compile generation.

    Raises ValueError (naming the key) if this host cannot build it."""
    from cadence.actors.engine import JaxEngine
    from cadence.actors.rewards import make_scorer
    from cadence.actors.tasks.registry import make_task
    from cadence.launch import compile_cache, config_loader
    from cadence.launch.config import Config
    from cadence.learner.models.policy import policy_skeleton

    cfg = config_loader.merge(Config(), config)
    if cfg.actors.engine == "sglang":
        cfg = local_sglang(cfg, tuple(sglang_urls), log)
    config_loader.validate_tree(cfg)
    compile_cache.enable(cfg.run.jax_cache)  # this host's cache: a restarted actor loads its programs
    policy = policy_skeleton(cfg)  # shapes and tokenizer; the weights come from the learner
    task = make_task(cfg.task, policy.tokenizer)
    engine = None
    if cfg.actors.engine == "jax":
        engine = JaxEngine(policy.model_cfg, policy.graphdef, cfg.engine, policy.tokenizer.eos_id,
                           policy.tokenizer.pad_id)
        if warm:  # one call as the actor loop makes it (zero weights): its programs get compiled now
            import jax
            import numpy as np

            from cadence.actors.episodes import generate_rollouts

            zeros = engine.place(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), policy.params))
            rows = [task.prompt(i) for i in range(cfg.actors.prompts_per_call) for _ in range(cfg.learner.group_size)]
            generate_rollouts(engine, zeros, task, rows, jax.random.fold_in(jax.random.key(cfg.actors.seed), 0))
    return Parts(config, cfg, policy, task, engine, make_scorer(cfg.task, task, policy.tokenizer))


def _build(parts: Parts, welcome, client, actor_id, ctx, keys, log, sglang_urls=(),
           local: _LocalFiles | None = None):
    from cadence.actors.actor_loop import Actor
    from cadence.actors.env_runner import EnvRunner
    from cadence.actors.remote_weights import RemoteWeights
    from cadence.actors.tasks.base import is_multi_turn
    from cadence.actors.sglang.build import sglang_engine
    from cadence.protocols.weights_wire import WeightClient

    cfg, policy, task, engine = parts.cfg, parts.policy, parts.task, parts.engine
    if cfg.actors.engine == "sglang":
        local = local or _LocalFiles("")
        work_dir = local.get(actor_id, cfg.actors.sglang.work_dir)
        engine = sglang_engine(cfg, policy, work_dir)
        where = ", ".join(sglang_urls) if sglang_urls else f"{cfg.actors.sglang.num_servers} launched here"
        log(f"{actor_id}: SGLang servers: {where} (sync {cfg.actors.sglang.sync}, files in {work_dir})")
    template, transform = policy.params, None
    if cfg.actors.engine == "jax" and engine.mesh is not None:  # tensor-parallel: weights arrive in the shards
        template = engine.abstract_params(template)
        log(f"{actor_id}: built-in engine tensor-parallel over {engine.mesh.size} "
            f"{engine.mesh.mesh.devices.flat[0].platform} devices (each holds 1/{engine.mesh.size} of the model)")
    if cfg.learner.lora.rank > 0:  # the learner sends adapters: merged here into this host's base
        template, transform = _lora_weights(cfg, policy, log, actor_id)
    weights = RemoteWeights(lambda endpoint: WeightClient(endpoint, ctx=ctx, keys=keys), template,
                            endpoint_fn=lambda: (client.welcome.weights_endpoint, *client.welcome.weights_shards),
                            transform=transform)
    log(f"{actor_id}: joined session {welcome.session} (task {task.name}, {cfg.learner.group_size} completions "
        f"per prompt, {welcome.concurrency} prompts per call)")
    return Actor(actor_id, engine, task, client, weights, cfg.learner.group_size, welcome.concurrency,
                 cfg.actors.seed, scorer=parts.scorer,
                 envs=EnvRunner.from_config(cfg.task) if is_multi_turn(task) else None)


def _lora_weights(cfg, policy, log, actor_id):
    """A LoRA run's (adapters template, merge): the base is read from model.path on this host,
    once; each new version's adapters are merged into it once (W + alpha / r * A B)."""
    import functools

    import jax

    from cadence.learner.models import hf_load, lora

    _, adapters = lora.lora_graphdef(policy.model_cfg, cfg.learner.lora)
    _, _, base = hf_load.load_checkpoint(cfg.model.path, cfg.model)
    merge = jax.jit(functools.partial(lora.merge_weights, lora_cfg=cfg.learner.lora))
    log(f"{actor_id}: LoRA rank {cfg.learner.lora.rank}: fetching adapters "
        f"({lora.adapter_bytes(adapters) / 2**20:.1f} MiB) and merging them into the base from {cfg.model.path}")
    return adapters, lambda fetched: merge(base, fetched)


def _from_parent(stop: threading.Event, log, sglang_urls: tuple[str, ...] = ()) -> tuple[str, Parts | None] | None:
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
                parts = prepare(msg["config"], warm=True, sglang_urls=sglang_urls, log=log)
            except Exception as e:  # built again (and reported) when the Welcome brings the config
                log(f"could not prepare from the parent's config: {type(e).__name__}: {e}")
        if "connect" in msg:
            return msg["connect"], parts
    if parts is not None:
        parts.scorer.close()
    return None


def main(endpoint: str, actor_id: str, keys_dir: str, sglang_urls: tuple[str, ...] = (), work_dir: str = "") -> int:
    stop = threading.Event()

    def handle(signum, frame):
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
    parts = None
    if endpoint == "-":
        got = _from_parent(stop, lambda text: print(f"cadence actor: {actor_id}: {text}", file=sys.stderr,
                                                     flush=True), tuple(sglang_urls))
        if got is None:
            return EXIT_OK
        endpoint, parts = got
    return run_actor(endpoint, actor_id, keys_dir, stop, sglang_urls=tuple(sglang_urls), work_dir=work_dir,
                     parts=parts)
