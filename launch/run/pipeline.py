"""The generation side as the learner sees it: one dispatcher, a weight server, and the actors.

    pipe = Pipeline(cfg, run_dir, task, stream, ledger, batch_size, weights, engine, restored_groups, progress)
    pipe.start()                    # dispatcher thread; actor threads or processes; listener for more
    loop = LearnerLoop(train_step, pipe.queue, pipe.gate, pipe, ...)   # pipe.publish(params, v) each step
    ...
    metrics = pipe.evaluate(version)   # held-out evaluation as work for the actor processes
    pipe.stop(deadline, finished)   # actors leave; prompts still in flight stay in the ledger

Actors are threads in this process (`actors.processes=0`, the default) or processes started and
restarted by launch/cluster/supervisor.py; either way they speak the dispatcher protocol
(protocols/dispatch.py), threads over `inproc://`, processes over `actors.listen`. By default that is
an `ipc://` socket in RUN_DIR/sockets (mode 0700), which only this user's processes on this host can
reach: they join with `cadence actor --connect ENDPOINT` (the endpoint is in RUN_DIR/endpoint.json);
tcp beyond loopback needs actors.keys_dir (Curve), and every refused handshake is counted
(actors/refused_connections). The learner's
queue is unbounded: backpressure (`actors.queue_size`) holds back grants instead, so restoring a
checkpoint's queued groups never blocks.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings

import zmq

from cadence.actors.actor_loop import Actor
from cadence.actors.env_runner import EnvRunner
from cadence.actors.evaluation import heldout_metrics
from cadence.actors.tasks.base import Score, is_multi_turn
from cadence.launch.artifacts import ENDPOINT_FILE
from cadence.launch.cluster.supervisor import ActorSupervisor
from cadence.launch.config import completion_budget
from cadence.learner.loop import PipelineStopped
from cadence.learner.models.named_arrays import ParamLayout
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.dispatch import Dispatcher, DispatchSettings
from cadence.protocols.dispatch_server import DispatchServer
from cadence.protocols.dispatch_client import DispatcherClient
from cadence.protocols.ledger import SampleLedger
from cadence.protocols.messages import Control
from cadence.protocols.transport import InProcessTransport
from cadence.protocols.weights import InProcessWeights
from cadence.protocols.weights_wire import WeightServer
from cadence.protocols.zmq_transport import CurveKeys, private_dir, stop_authenticator



class Pipeline:
    """The generation side: dispatcher and its admission gate, weight server, actors (module docstring).

    batch_size: B in force at the start (the controller's course); the gate counts admissions with
    it from the weights' version on (one batch taken per version), the restored groups already in line.
    """

    def __init__(self, cfg, run_dir: str, task, stream, ledger: SampleLedger, batch_size: int,
                 weights: InProcessWeights, engine, restored_groups, progress, config_dict: dict, scorer=None,
                 supervisor: ActorSupervisor | None = None, remote_params=None, shard_stream=None,
                 weights_shards: tuple[str, ...] = ()):
        a = cfg.actors
        restored_groups = list(restored_groups)
        # on_change: the dispatcher re-checks waiting actors at once (the server is built below,
        # before anything can change the gate)
        self.gate = gate = AdmissionGate(batch_size, a.max_staleness, on_change=lambda: self.server.wake(),
                                         steps_taken=weights.version,
                                         issued=cfg.learner.group_size * len(restored_groups))
        self.cfg, self.run_dir, self.progress = a, run_dir, progress
        self.task = task
        self._heldout = None  # task.heldout(), built at the first evaluate()
        self._aborted = threading.Event()  # a stop signal came: an evaluation in progress gives up
        self.weights, self.engine = weights, engine
        self.queue = InProcessTransport()  # groups for the learner
        for g in restored_groups:  # buffered trajectories, in their original order
            self.queue.put(g)
        self.ctx = zmq.Context()
        self.keys = CurveKeys.load(a.keys_dir) if a.keys_dir else None
        self._failures: list[str] = []  # fatal: a thread actor failed or hung (threads cannot be restarted)
        self._thread_ids: set[str] = set()
        self.supervisor = supervisor  # actors.processes, started with the run (start_actor_processes)
        self._socket_dir = ""  # the ipc sockets' directory (RUN_DIR/sockets, or a short one elsewhere)
        listen, weights_listen = self._endpoints(a.listen)
        if listen.startswith("tcp://") and self.keys is None:  # loopback (config validation refused the rest)
            progress.message(f"actors.listen={a.listen} without actors.keys_dir: any user on this host can "
                             "connect to the run; the default (ipc://, in the run directory) admits only yours")
        self.weight_server = WeightServer(weights_listen, ctx=self.ctx, keys=self.keys, key_name="actors.keys_dir") \
            if listen else None
        # shard_stream(params, paths, version) -> a WeightSource: a sharded learner's weights go out in buckets
        # of its shards (learner/weight_stream.py); None: whole arrays (a one-device learner)
        self.shard_stream = shard_stream
        if self.weight_server is not None:
            params, version = weights.latest()
            # remote_params: what actor processes get instead (a LoRA run's adapters; see publish)
            params = params if remote_params is None else remote_params
            self.layout = ParamLayout(params)
            self._serve(version, params)
        settings = DispatchSettings(
            group_size=cfg.learner.group_size, heartbeat_seconds=a.heartbeat_seconds,
            heartbeat_timeout_seconds=a.heartbeat_timeout_seconds,
            liveness_timeout_seconds=a.liveness_timeout_seconds, queue_size=a.queue_size,
            concurrency=a.prompts_per_call, config=config_dict,
            weights_endpoint=self.weight_server.endpoint if self.weight_server else "",
            weights_shards=tuple(weights_shards),  # the other learner processes' pieces (shard_stream)
            # what a group may hold (protocols/group_checks.py): the learner's rows are built for these
            max_completion_tokens=completion_budget(cfg, task),
            vocab_size=getattr(getattr(engine, "model_cfg", None), "vocab_size", 0),
            max_abs_reward=a.max_abs_reward)
        core = Dispatcher(stream, ledger, gate, settings, deliver=self.queue.put, version_fn=lambda: weights.version,
                          on_actor_gone=self._gone, on_hung=self._hung, on_bad_group=self._bad_group)
        self.server = DispatchServer(core, ctx=self.ctx, external=listen, keys=self.keys,
                                     max_bytes=int(a.max_message_mb * (1 << 20)))
        self.endpoint = self.server.endpoint
        if self.endpoint:
            auth = "curve" if self.keys else "same_user" if self.endpoint.startswith("ipc://") else "none"
            with open(os.path.join(run_dir, ENDPOINT_FILE), "w") as f:
                json.dump({"dispatch": self.endpoint, "weights": settings.weights_endpoint, "pid": os.getpid(),
                           "curve": bool(self.keys), "auth": auth}, f)
        self.stop_event = threading.Event()
        self._stopped = False
        self.actors: list[Actor] = []
        self._threads: list[threading.Thread] = []
        n_threads = 0 if a.processes else a.num_actors
        # one pool for the environments of every actor thread (task.env_threads, task.env_timeout_s)
        envs = EnvRunner.from_config(cfg.task) if n_threads and is_multi_turn(task) else None
        for i in range(n_threads):
            actor_id = f"actor-{i}"
            client = DispatcherClient(self.server.inproc, actor_id, a.prompts_per_call, ctx=self.ctx,
                                      max_bytes=int(a.max_message_mb * (1 << 20)), heartbeat_seconds=a.heartbeat_seconds,
                                      learner_timeout_seconds=a.heartbeat_timeout_seconds)
            self.actors.append(Actor(actor_id, engine, task, client, weights, cfg.learner.group_size,
                                     a.prompts_per_call, a.seed, scorer=scorer, envs=envs))
            self._thread_ids.add(actor_id)

    def _endpoints(self, listen: str) -> tuple[str, str]:
        """Where to listen: `ipc://` alone is a socket in RUN_DIR/sockets (0700; the same path on a
        resume); a resume keeps the tcp ports it had, so actors outside reconnect."""
        if not listen:
            return "", ""
        if listen == "ipc://":
            # removed at stop, also inside the run directory: a socket file left there breaks
            # copying the run (shutil.copytree: "No such device or address"); a resume binds again
            self._socket_dir = private_dir(self.run_dir)
            return f"ipc://{self._socket_dir}/dispatch", f"ipc://{self._socket_dir}/dispatch.weights"
        host = listen.rsplit(":", 1)[0]
        weights = f"{host}:0" if listen.startswith("tcp://") else listen + ".weights"
        saved = os.path.join(self.run_dir, ENDPOINT_FILE)
        if listen.startswith("tcp://") and listen.endswith(":0") and os.path.isfile(saved):
            with open(saved) as f:
                old = json.load(f)
            if old.get("dispatch", "").rsplit(":", 1)[0] == host and _port_free(old["dispatch"]) \
                    and _port_free(old.get("weights", "")):
                return old["dispatch"], old.get("weights") or weights
            warnings.warn(f"actors.listen: the ports this run had ({old.get('dispatch')}) are taken; actors "
                          "started outside must reconnect to the new endpoint in " + saved, stacklevel=2)
        return listen, weights

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Pipeline":
        if self.weight_server is not None:
            self.weight_server.start()
        self.server.start()
        for actor in self.actors:
            actor.client.start()
            t = threading.Thread(target=self._run_thread, args=(actor,), name=actor.actor_id, daemon=True)
            t.start()
            self._threads.append(t)
        if self.supervisor is not None:  # the processes prepared meanwhile: now they join
            self.supervisor.connect(self.endpoint, on_exit=self._process_exited)
        return self

    def _run_thread(self, actor: Actor) -> None:
        try:
            actor.run(self.stop_event)
        except BaseException:  # kept in actor.error; health() raises it on the learner's thread
            pass

    def stop(self, deadline: float, finished: bool) -> None:
        """Actors leave (their prompts in flight stay in the ledger, re-issued on resume). A finished
        run tells actors outside this process to exit; a preempted one leaves them waiting for the
        resume. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if finished:
            self._tell_actors_finished(deadline)
        self.stop_event.set()
        for t in self._threads:
            t.join(_left(deadline))
        if self.supervisor is not None:
            self.supervisor.stop(_left(deadline))
        for actor in self.actors:
            actor.client.close(timeout=min(0.5, _left(deadline)))
        self.server.stop(min(2.0, _left(deadline)))
        if self.weight_server is not None:
            self.weight_server.stop(min(2.0, _left(deadline)))
        stop_authenticator(self.ctx)
        self.ctx.destroy(linger=0)
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _tell_actors_finished(self, deadline: float, patience: float = 3.0) -> None:
        """Say "finished" until every actor has said Goodbye, or for `patience` seconds: a word
        sent once can be lost with the sockets that close right after, and an actor that missed
        it would wait for a learner that never comes back."""
        until = time.monotonic() + min(patience, _left(deadline))
        while True:
            self.server.call(lambda core: core.control_all(Control(stop=True, reason="finished")))
            time.sleep(0.1)
            with self.server.lock:
                outside = [a for a in self.server.core.actors if a not in self._thread_ids]
            if not outside or time.monotonic() >= until:
                return
            time.sleep(0.15)

    def abort(self) -> None:
        """On a stop signal: cut in-flight generation short (SGLang requests) instead of finishing it."""
        self._aborted.set()
        if self.engine is not None:
            self.engine.abort()

    # -- what the learner loop calls ------------------------------------------------------------
    def publish(self, params, version: int, remote=None) -> None:
        """params: what actor threads run; remote: what actor processes fetch, if not params (a
        LoRA run's adapters, which the process merges into its own copy of the base)."""
        served = params if remote is None else remote
        if self.weight_server is not None:  # first: the dispatcher may grant `version` right after
            self._serve(version, served)
        self.weights.publish(params, version)
        self.server.wake()

    def _serve(self, version: int, served) -> None:
        if self.shard_stream is not None:
            self.weight_server.publish_source(version, self.shard_stream(served, self.layout.paths, version))
        else:
            self.weight_server.publish(version, lambda: self.layout.named(served))

    @property
    def version(self) -> int:
        return self.weights.version

    def evaluate(self, version: int) -> dict:
        """Held-out evaluation of weights `version` as work for the actors: the dispatcher hands
        the held-out prompts out in chunks (first, before training prompts), each actor generates
        greedily with exactly that version and scores with the task's reward, and this waits for
        every chunk (re-issued when its actor dies or hangs). The eval/* metrics of
        actors/evaluation.py, plus eval/seconds (wall time) and eval/generate_seconds (the actors'
        engine time). `version` must be the newest published: the learner waits meanwhile.

        Raises PipelineStopped if the generation side fails meanwhile; returns {} if a stop signal
        came (the run checkpoints and exits instead of evaluating)."""
        if version != self.version:
            raise ValueError(f"evaluate: version {version} is not the newest published ({self.version})")
        if self._heldout is None:
            self._heldout = list(self.task.heldout())
        prompts = self._heldout
        t0 = time.monotonic()
        done = threading.Event()
        self.server.call(lambda core: core.start_eval(version, list(range(len(prompts))),
                                                      [p.prompt_id for p in prompts], self.cfg.processes,
                                                      on_done=lambda job: done.set()))
        try:
            while not done.wait(0.05):
                self.health()
                if self._aborted.is_set() or self.stop_event.is_set():
                    self.progress.message(f"held-out evaluation of version {version}: given up, the run is stopping")
                    return {}
        finally:
            if not done.is_set():  # answers still on their way are dropped as late
                self.server.call(lambda core: core.evals.cancel() or [])
        with self.server.lock:
            job = self.server.core.evals.job
            if job.failed:
                raise PipelineStopped(f"held-out evaluation on the actors: {job.failed}")
            scores = [Score(p.reward, p.exact_match, p.metrics, p.error) for p in job.ordered()]
            engine_seconds, reissued = job.generate_seconds, job.reissued
        metrics = heldout_metrics(scores, prompts)
        metrics["eval/seconds"] = time.monotonic() - t0
        metrics["eval/generate_seconds"] = engine_seconds
        if reissued:
            metrics["eval/reissued_chunks"] = reissued
        return metrics

    def set_concurrency(self, c: int) -> None:
        self.server.call(lambda core: core.control_all(Control(concurrency=int(c))))
        for actor in self.actors:
            actor.set_concurrency(c)

    @property
    def concurrency(self) -> int:
        return self.server.core.concurrency

    def health(self) -> None:
        """Raise PipelineStopped naming the actor and its own error if the generation side failed."""
        for a in self.actors:
            if a.error is not None:
                raise PipelineStopped(f"{a.actor_id} failed: {type(a.error).__name__}: {a.error}") from a.error
        if self._failures:
            raise PipelineStopped(self._failures[0])
        if self.server.error is not None:
            raise PipelineStopped(f"dispatcher failed: {self.server.error!r}") from self.server.error
        if self.weight_server is not None and self.weight_server.error is not None:
            raise PipelineStopped(f"weight server failed: {self.weight_server.error!r}") from self.weight_server.error

    def metrics(self) -> dict:
        out = self.server.metrics()
        if self.weight_server is not None:  # a stranger may try either socket
            out["actors/refused_connections"] += self.weight_server.refused.refused
            # weight transfers to actor processes (cumulative; a LoRA run sends adapters only)
            out["actors/weights_sent"] = self.weight_server.sent
            out["actors/weights_sent_bytes"] = self.weight_server.sent_bytes
        with self.server.lock:
            totals = self.server.core.totals()
        out["actors/samples_received"] = totals.get("samples", 0)
        out["actors/generate_seconds"] = totals.get("generate_seconds", 0.0)
        out["actors/tokens_received"] = totals.get("tokens", 0)
        out["actors/concurrency"] = self.concurrency
        if self.supervisor is not None:
            out["actors/restarts"] = self.supervisor.restarts
        return out

    # -- callbacks from the dispatcher and the supervisor ---------------------------------------
    def _gone(self, actor_id: str, reason: str, error: bool) -> None:
        if self.stop_event.is_set() or (actor_id in self._thread_ids and error):
            return  # stopping anyway; or a failed thread, whose own exception health() raises
        self.progress.message(f"{actor_id}: gone ({reason})")

    def _hung(self, actor_id: str, detail: str) -> None:
        self.progress.message(detail)
        if actor_id in self._thread_ids:
            self._failures.append(detail)  # a thread cannot be killed: the run stops, naming it
        elif self.supervisor is not None and self.supervisor.pid(actor_id) is not None:
            self.supervisor.kill(actor_id)  # restarted like any dead process

    def _bad_group(self, actor_id: str, detail: str) -> None:
        self.progress.message(detail)
        if actor_id in self._thread_ids:  # our own actor thread built it: a bug, so the run stops, naming it
            self._failures.append(detail)

    def _process_exited(self, actor_id: str, reason: str) -> None:
        self.server.call(lambda core: core.expel(actor_id, reason, error=True) or [])


def start_actor_processes(cfg, run_dir: str, message, config_dict: dict) -> ActorSupervisor:
    """cfg.actors.processes actor processes, started now: they prepare from config_dict (model,
    engine, compiled generation) while the learner builds, and join when Pipeline.start() hands
    them the endpoint."""
    a = cfg.actors
    return ActorSupervisor(a.processes, None, run_dir, keys_dir=a.keys_dir, backoff=a.restart_backoff_seconds,
                           message=message, config=config_dict,
                           extra_args=lambda actor_id: _process_args(a, run_dir, actor_id)).start()


def _process_args(a, run_dir: str, actor_id: str) -> list[str]:
    """engine=sglang: each process's servers keep their files in its own folder (a restart reuses
    its compilation cache); with processes=1, sglang.urls are that process's servers."""
    if a.engine != "sglang":
        return []
    work_dir = os.path.join(a.sglang.work_dir or os.path.join(run_dir, "sglang"), actor_id)
    return ["--work-dir", work_dir] + [arg for u in a.sglang.urls for arg in ("--sglang-url", u)]


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.05)


def _port_free(endpoint: str) -> bool:
    import socket

    if not endpoint.startswith("tcp://"):
        return bool(endpoint)
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no obstacle
        try:
            s.bind((host.strip("[]"), int(port)))
            return True
        except OSError:
            return False
