"""The learner's processes: starting N of them on one machine, and wiring one into a run.

`cadence train learner.processes=N` (run_local_group) re-runs the same command N times with the
group in the environment (CADENCE_COORDINATOR=127.0.0.1:PORT, CADENCE_NUM_PROCESSES,
CADENCE_PROCESS_ID) and one run.dir. Process 0 is the run as one process would do it (actors,
metrics, summary, its stdout is this command's); processes 1..N-1 follow it (learner/leader.py).
On a cluster, start one process per host yourself with learner.distributed.* set (or
auto_detect under SLURM / on TPU pods); the rest is the same.

`LearnerProcesses` is what launch/run/train.py asks of the group: the layout, the wrappers that make
process 0's collective calls reach the others, whole weights for the engine and exports, and the
follower's loop.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

from cadence.launch.config_loader import ConfigError
from cadence.learner import multihost, row_plan, sharding
from cadence.learner.leader import Follower, Leader
from cadence.learner.models.llama import abstract_params
from cadence.learner.weight_stream import ShardStream

STOP_GRACE_S = 60.0  # followers get this long to finish after process 0 exits
WEIGHT_SERVER_FAILED = 70  # a learner process's exit status when its weight server failed (EX_SOFTWARE)
_WEIGHTS_KEY = "cadence/weights"  # key-value store: each learner process's weight server


def _bucket_bytes(actors_cfg) -> int:
    return max(1, int(actors_cfg.weights_bucket_mb * (1 << 20)))


def _this_host(listen: str) -> bool:
    """Whether every learner process's weight server has an address actors reach: on this host,
    or the one its launcher gave it (multihost.ENV_WEIGHTS_HOST)."""
    if listen.startswith("ipc://") or (listen.startswith("tcp://") and os.environ.get(multihost.ENV_WEIGHTS_HOST)):
        return True
    host = listen[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_parent(signum: int) -> Callable[[], None]:
    """preexec_fn: a session of its own (a terminal's Ctrl-C reaches only this launcher, which
    passes it on once), and signum when the launcher dies (Linux; elsewhere only the session)."""

    def setup() -> None:
        os.setsid()
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    return setup


def run_local_group(train_args: list[str], num_processes: int, run_dir: str) -> int:
    """Starts `cadence train *train_args` as num_processes learner processes; returns process
    0's exit status (non-zero if any process failed). SIGINT/SIGTERM go to process 0, which saves
    a final checkpoint and stops the others."""
    env = {**os.environ, multihost.ENV_COORDINATOR: f"127.0.0.1:{_free_port()}",
           multihost.ENV_NUM_PROCESSES: str(num_processes)}
    cmd = [sys.executable, "-m", "cadence.launch.cli", "train", *train_args, f"run.dir={run_dir}"]
    procs = []
    for i in range(num_processes):  # process 0 checkpoints if the launcher dies; the others just go
        procs.append(subprocess.Popen(cmd, env={**env, multihost.ENV_PROCESS_ID: str(i)},
                                      stdout=None if i == 0 else subprocess.DEVNULL,
                                      preexec_fn=_with_parent(signal.SIGTERM if i == 0 else signal.SIGKILL)))
    leader = procs[0]

    def forward(signum, frame):
        if leader.poll() is None:
            leader.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while leader.poll() is None:
            if any(p.poll() not in (None, 0) for p in procs[1:]):  # a follower died: nothing can finish
                failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                print(f"cadence: learner process {failed[0]} exited with {procs[failed[0]].returncode}; "
                      "stopping the group", file=sys.stderr)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                return 1
            time.sleep(0.2)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs[1:]:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        codes = [p.returncode for p in procs]
        return codes[0] or next((c for c in codes[1:] if c), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for s, h in old.items():
            signal.signal(s, h)


@dataclasses.dataclass
class LearnerProcesses:
    """This process's part of the learner: its group, the mesh layout, and (process 0) the leader."""

    group: multihost.Group
    layout: sharding.Layout | None
    out_dtype: str | None  # dtype weights leave the learner in (master weights are float32)
    leader: Leader | None = None
    stopped: bool = False
    # the learner config to build with: the run's, with the microbatch re-planned for this mesh
    learner: Any = None
    plan_notes: tuple[str, ...] = ()  # what the re-plan changed (logged by process 0)

    @classmethod
    def start(cls, cfg, model_cfg) -> "LearnerProcesses":
        """Joins the group (before any JAX work) and lays the model out on the mesh.

        Raises ConfigError naming the key of a group or mesh that does not fit the devices. A
        microbatch that does not split over the mesh's row devices is re-planned (plan_notes)."""
        try:
            group = multihost.join(cfg.learner.distributed)
            _, abstract = abstract_params(model_cfg)
            layout = sharding.make_layout(cfg.learner.mesh, abstract)
        except ValueError as e:  # their messages name the key
            raise ConfigError(str(e)) from None
        # rows per device for the mesh this start got (an elastic restart may get fewer or more
        # devices): a microbatch that splits over it, never a refusal (learner/row_plan.py)
        plan = row_plan.plan_rows(cfg.learner, layout.rows if layout is not None else 1)
        out_dtype = model_cfg.param_dtype if cfg.learner.master_weights else None
        return cls(group, layout, out_dtype, learner=plan.learner, plan_notes=plan.notes)

    # ---- process 0 ----
    def lead(self, params, train_step, checkpointer, sft_step) -> tuple[Any, Any, Any]:
        """The train step, checkpointer and warm-up step process 0 uses: each call also reaches
        the other processes (unchanged in a one-process learner). params: the initial ones."""
        if not self.group.distributed:
            return train_step, checkpointer, sft_step
        self.leader = Leader(self.group, self.layout, params)
        atexit.register(self.stop)  # followers must not wait forever if process 0 fails
        lead = self.leader
        return lead.wrap_step(train_step), lead.wrap_checkpointer(checkpointer), lead.wrap_sft(sft_step)

    def on_whole(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """fn(params) called with the params whole on this process (e.g. held-out evaluation)."""
        return lambda params: fn(self.gather(params))

    def publisher(self, whole: bool) -> Callable[[Any], Any]:
        """What the learner loop publishes to actors: whole params (built-in engine, actor
        processes), or the learner's own (an SGLang sync fetches a bucket at a time)."""
        if not whole or (self.layout is None and self.out_dtype is None):
            return lambda params: params
        return self.gather

    def streams_weights(self, actors_cfg) -> bool:
        """Whether actor processes fetch buckets of the shards (learner/weight_stream.py) rather
        than whole arrays: a sharded learner whose processes all serve on this host (ipc:// or
        loopback, or each process's address from its launcher, as cadence launch ray gives). The
        same answer in every process (it reads the config and the launcher's environment)."""
        return self.layout is not None and (not self.group.distributed or _this_host(actors_cfg.listen))

    def shard_stream(self, actors_cfg) -> Callable | None:
        """(params, paths, version) -> a WeightSource of this process's shards in buckets of
        actors.weights_bucket_mb MiB, the other learner processes publishing theirs of the same
        version (Follower's "publish" call); None where actor processes get whole arrays."""
        if not self.streams_weights(actors_cfg):
            return None
        make = functools.partial(ShardStream, dtype=self.out_dtype, bucket_bytes=_bucket_bytes(actors_cfg))
        if self.leader is None:
            return lambda params, paths, version: make(params, paths)

        def stream(params, paths, version):
            self.leader.call("publish", lambda: None, {"version": int(version)}, params)
            return make(params, paths)

        return stream

    def weights_shards(self, timeout_s: float = 120.0) -> tuple[str, ...]:
        """Process 0: the other learner processes' weight servers (each set its endpoint in the
        jax.distributed key-value store when it started serving; Follower side: follow())."""
        if self.leader is None:
            return ()
        from jax._src import distributed

        client = distributed.global_state.client
        return tuple(client.blocking_key_value_get(f"{_WEIGHTS_KEY}/{p}", int(timeout_s * 1000))
                     for p in range(1, self.group.num_processes))

    def gather(self, params):
        """params whole on this process's first device, in the model's dtype (engine, eval)."""
        if self.leader is not None:
            return self.leader.gather(params, self.out_dtype)
        return sharding.gather(params, self.layout, self.out_dtype)

    def fetch(self, arrays: list) -> list:
        """Some param arrays whole on this process (an export shard, a weight-sync bucket)."""
        if self.leader is not None:
            return self.leader.fetch(arrays, self.out_dtype)
        return sharding.gather(list(arrays), self.layout, self.out_dtype)

    def save_params(self, run_dir: str, params, save: Callable[[str, Any], None]) -> None:
        """The final params, every process writing its shards (orbax)."""
        if self.leader is None:
            save(run_dir, params)
        else:
            self.leader.call("save_params", lambda: save(run_dir, params), {"run_dir": run_dir}, params)

    def stop(self) -> None:
        if self.leader is not None and not self.stopped:
            self.stopped = True
            self.leader.stop()

    # ---- processes 1..N-1 ----
    def _serve_pieces(self, actors_cfg, run_dir: str):
        """A weight server for this process's pieces, its endpoint in the key-value store for
        process 0 to hand to actors; and the "publish" call that serves a version."""
        import zmq
        from jax._src import distributed

        from cadence.learner.models.named_arrays import ParamLayout
        from cadence.protocols.weights_wire import WeightServer
        from cadence.protocols.zmq_transport import CurveKeys, private_dir

        listen, pid = actors_cfg.listen, self.group.process_id
        host = os.environ.get(multihost.ENV_WEIGHTS_HOST)
        where = f"ipc://{private_dir(run_dir)}/weights.{pid}" if listen.startswith("ipc://") \
            else f"tcp://{host}:0" if host else f"{listen.rsplit(':', 1)[0]}:0"
        ctx = zmq.Context()
        keys = CurveKeys.load(actors_cfg.keys_dir) if actors_cfg.keys_dir else None
        # retain 2: an actor takes process 0's newest, then asks here for that version, which the
        # learner may have moved past meanwhile
        # on_error: this process's main thread waits in a collective for process 0's next command and
        # cannot notice; exiting makes process 0's next collective fail, so the run fails (or its
        # launcher restarts the group) instead of actors waiting forever for pieces no one serves
        server = WeightServer(where, ctx=ctx, keys=keys, key_name="actors.keys_dir", retain=2,
                              on_error=lambda e: os._exit(WEIGHT_SERVER_FAILED)).start()
        distributed.global_state.client.key_value_set(f"{_WEIGHTS_KEY}/{pid}", server.endpoint)
        make = functools.partial(ShardStream, dtype=self.out_dtype, bucket_bytes=_bucket_bytes(actors_cfg))

        def publish(meta, params):
            server.publish_source(meta["version"], make(params, ParamLayout(params).paths))

        return (server, ctx), publish

    def follow(self, params, train_step, checkpointer, arrays_of: Callable, sft=None,
               save_params: Callable[[str, Any], None] | None = None, actors_cfg=None, run_dir: str = "") -> dict:
        """Runs what process 0 sends until it stops; returns a one-line summary. actors_cfg,
        run_dir: where this process serves its pieces of the weights to actor processes, when
        streams_weights(actors_cfg)."""
        calls = {"save_params": lambda meta, p: save_params(meta["run_dir"], p)}
        server = None
        if actors_cfg is not None and run_dir and self.streams_weights(actors_cfg):
            server, calls["publish"] = self._serve_pieces(actors_cfg, run_dir)
        follower = Follower(self.group, self.layout, train_step, params, checkpointer, arrays_of, sft, calls)
        try:
            final = follower.run()
        finally:
            if not follower.checkpointer_closed:
                checkpointer.close()
            if server is not None:
                server[0].stop(2.0)
                server[1].destroy(linger=0)
        return {"process_id": self.group.process_id, "steps": int(final.step),
                "commands": follower.channel.commands}
