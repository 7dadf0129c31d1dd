"""Configuration of the generation side: how many actors, how much each asks of its engine."""
from __future__ import annotations

import dataclasses
import ipaddress
import os
from typing import Literal

from cadence.actors.sglang.server import CPU_ARGS


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


@dataclasses.dataclass(frozen=True)
class SGLangConfig:
    """SGLang servers: attached by URL, or launched and owned by Cadence (see actors/sglang/)."""

    urls: tuple[str, ...] = ()  # servers to attach to, e.g. ("http://10.0.0.5:30000",); empty = launch our own
    num_servers: int = 1  # servers to launch when urls is empty
    launch_python: str = ""  # python of the venv with sglang / sglang-jax ("" = $CADENCE_SGLANG_PYTHON)
    launch_module: str = "sgl_jax.launch_server"  # sglang-jax; main SGLang is "sglang.launch_server"
    launch_args: tuple[str, ...] = CPU_ARGS  # arguments after --model-path/--host/--port (default: sglang-jax on CPU, see actors/sglang/server.py)
    launch_env: tuple[str, ...] = ("JAX_PLATFORMS=cpu",)  # KEY=VALUE pairs added to the server's environment
    compile_cache: bool = True  # launched servers share a JAX compilation cache in work_dir/jax-cache (faster restarts)
    host: str = "127.0.0.1"  # interface launched servers listen on
    port: int = 0  # first port of launched servers (server i uses port + i); 0 = free ports
    work_dir: str = ""  # exported checkpoints and server logs ("" = RUN_DIR/sglang)
    startup_timeout_s: float = 600.0  # a launched server must answer /health_generate within this
    request_timeout_s: float = 120.0  # per /generate request (then the server counts as unavailable)
    retries: int = 3  # re-issues of one request after misaligned, malformed or HTTP-error responses
    backoff_s: float = 0.2  # first retry delay; doubles with each failure
    concurrency: int = 16  # requests in flight per server
    heartbeat_s: float = 5.0  # /health_generate (and process liveness) check interval
    sync: Literal["restart", "disk", "distributed"] = "restart"  # weight sync (actors/sglang/weight_sync/, one file each): restart on a new checkpoint (sglang-jax), /update_weights_from_disk or a torch.distributed broadcast (main SGLang)
    sync_every: int = 0  # also sync once servers lag this many versions (0 = only when the staleness bound needs it)
    # sync="distributed" (actors/sglang/weight_broadcast.py): the learner is rank 0 of a group the servers join.
    dist_backend: Literal["nccl", "gloo"] = "nccl"  # nccl between GPUs; gloo over TCP (CPU)
    dist_address: str = "127.0.0.1"  # this learner host's address as the servers reach it; the rendezvous store listens only here
    dist_port: int = 0  # rendezvous port (0 = a free one for each new group)
    dist_dtype: str = ""  # dtype sent ("" = the params' own; "bfloat16" for bf16 servers halves the bytes of float32 params)
    dist_bucket_mb: float = 512.0  # tensors per /update_weights_from_distributed request, by size
    dist_timeout_s: float = 300.0  # joining the group, and each bucket
    dist_trusted_network: bool = False  # allow a non-loopback dist_address: torch.distributed does not authenticate peers

    def validate(self) -> None:
        for name in ("num_servers", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("retries", "sync_every", "port"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("startup_timeout_s", "request_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s: must be >= 0, got {self.backoff_s}")
        if any(not u.startswith(("http://", "https://")) for u in self.urls):
            raise ValueError(f"urls: each must start with http:// or https://, got {self.urls}")
        if any("=" not in e for e in self.launch_env):
            raise ValueError(f"launch_env: entries must be KEY=VALUE, got {self.launch_env}")
        if self.dist_port < 0:
            raise ValueError(f"dist_port: must be >= 0, got {self.dist_port}")
        for name in ("dist_bucket_mb", "dist_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.dist_backend not in ("nccl", "gloo"):
            raise ValueError(f"dist_backend: must be 'nccl' or 'gloo', got {self.dist_backend!r}")
        if self.dist_dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"dist_dtype: must be '', 'float32', 'bfloat16' or 'float16', got {self.dist_dtype!r}")
        # The sync method's own rules (restart: launched servers; distributed: a loopback address).
        from cadence.actors.sglang.weight_sync import weight_sync_method

        weight_sync_method(self.sync).check_config(self)

    def resolved_python(self) -> str:
        """launch_python, or $CADENCE_SGLANG_PYTHON when it is empty ("" if neither is set)."""
        return self.launch_python or os.environ.get("CADENCE_SGLANG_PYTHON", "")


@dataclasses.dataclass(frozen=True)
class ActorsConfig:
    engine: Literal["jax", "sglang"] = "jax"  # generation engine: the built-in JAX sampler or SGLang servers
    num_actors: int = 1  # actor threads in the learner's process (used when processes = 0; 0 = only actors that join with `cadence actor`)
    processes: int = 0  # actor processes on this machine instead of threads, restarted if they die (engine=sglang: each launches its own servers)
    prompts_per_call: int = 16  # prompts per engine call (x group_size completions): the concurrency
    max_staleness: int = 1  # policy versions a sample may lag the step that trains on it; 0 = synchronous
    queue_size: int = 0  # bound on groups waiting for the learner (0 = no bound; admission bounds it anyway)
    seed: int = 0  # sampling RNG seed, shared by all actors (keys are folded with the prompt index)
    # where actor processes connect (`cadence actor --connect`, RUN_DIR/endpoint.json): "ipc://" = a socket in
    # RUN_DIR/sockets (0700) that only this user's processes on this host can reach; tcp://HOST:PORT for other
    # hosts (beyond loopback only with keys_dir; port 0 = a free one, kept across resumes); "" = none
    listen: str = "ipc://"
    keys_dir: str = ""  # CurveZMQ keys (`cadence keys DIR`): peers must authenticate; required to listen beyond loopback
    heartbeat_seconds: float = 1.0  # actors and learner tell each other they are alive this often
    heartbeat_timeout_seconds: float = 10.0  # an actor silent this long is gone: its prompts are re-issued
    liveness_timeout_seconds: float = 600.0  # an actor stuck this long in one phase (generating, scoring) with prompts in flight is hung
    restart_backoff_seconds: float = 1.0  # first delay before restarting a dead actor process; doubles while they keep dying
    max_message_mb: float = 64.0  # largest message accepted from an actor
    # a sharded learner streams weights to actor processes from its shards in buckets of at most this many
    # MiB (learner/weight_stream.py): the most any device or the learner's host holds beyond its shards
    weights_bucket_mb: float = 64.0
    max_abs_reward: float = 1e6  # a group with a larger |reward| is refused as bad (actors/bad_groups/reward_range)
    sglang: SGLangConfig = dataclasses.field(default_factory=SGLangConfig)  # used when engine=sglang

    def validate(self) -> None:
        if self.num_actors < 0:
            raise ValueError(f"num_actors: must be >= 0, got {self.num_actors}")
        if self.num_actors == 0 and self.processes == 0 and not self.listen:
            raise ValueError("num_actors: 0 actor threads and no actor processes need actors.listen, where actors "
                             "started with `cadence actor --connect` join")
        if self.prompts_per_call < 1:
            raise ValueError(f"prompts_per_call: must be >= 1, got {self.prompts_per_call}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.queue_size < 0:
            raise ValueError(f"queue_size: must be >= 0, got {self.queue_size}")
        if self.processes < 0:
            raise ValueError(f"processes: must be >= 0, got {self.processes}")
        if self.engine == "sglang" and self.processes > 1:
            # Each process drives its servers' weights on its own: shared servers would be synced by
            # several processes at once, and the versions each records would be wrong.
            if self.sglang.urls:
                raise ValueError(f"sglang.urls: with processes={self.processes} every actor process would drive "
                                 "the same servers; use processes=1, or start one `cadence actor --sglang-url URL` "
                                 "per set of servers")
            if self.sglang.port:
                raise ValueError(f"sglang.port: with processes={self.processes} each process launches servers "
                                 f"from port {self.sglang.port} and they collide; set 0 (free ports)")
        for name in ("heartbeat_seconds", "heartbeat_timeout_seconds", "liveness_timeout_seconds",
                     "max_message_mb", "max_abs_reward", "weights_bucket_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout_seconds < 2 * self.heartbeat_seconds:
            raise ValueError(f"heartbeat_timeout_seconds: {self.heartbeat_timeout_seconds} must be at least twice "
                             f"heartbeat_seconds ({self.heartbeat_seconds})")
        if self.restart_backoff_seconds < 0:
            raise ValueError(f"restart_backoff_seconds: must be >= 0, got {self.restart_backoff_seconds}")
        if self.listen and not self.listen.startswith(("tcp://", "ipc://")):
            raise ValueError(f"listen: {self.listen!r} must be tcp://HOST:PORT or ipc://PATH ('' = no listener)")
        if self.keys_dir and not os.path.isfile(os.path.join(self.keys_dir, "server.key_secret")):
            raise ValueError(f"keys_dir: {os.path.join(self.keys_dir, 'server.key_secret')} does not exist "
                             f"(write a key set with `cadence keys {self.keys_dir}`)")
        if self.listen:
            from cadence.protocols.zmq_transport import SecurityError, check_bind

            try:
                check_bind(self.listen, bool(self.keys_dir), "keys_dir")
            except SecurityError as e:
                raise ValueError(str(e)) from None
        launches = self.processes or self.num_actors  # someone on this host launches servers
        if self.engine == "sglang" and launches and not self.sglang.urls and not self.sglang.resolved_python():
            raise ValueError("sglang.launch_python: set it (or $CADENCE_SGLANG_PYTHON) to the python of "
                             "the SGLang venv, or attach running servers with sglang.urls")
