"""A learner over several processes (hosts): joining jax.distributed, and the command channel.

Every process holds its shards of the same arrays and must launch the same sharded computations in
the same order. Process 0 ("the leader") does everything a one-process learner does (actors,
learner loop, controller, metrics, checkpoint metadata); before each collective operation it
sends the operation to the other processes ("followers") over a `Channel`, and they run it too
(learner/leader.py: `Leader` sends, `Follower` runs what it is sent). A command is a name, a small
JSON object and named NumPy arrays: new optimizer hyperparameters, "save a checkpoint", "gather
the weights of params generation 7", "stop". It may carry a part for each process (an update's
microbatch rows, of which each process receives only those its devices hold).

    group = join(cfg.learner.distributed)       # first thing a process does: before any JAX work
    if group.is_leader: Leader(group, layout, params)       # wraps the step, SFT step and checkpointer
    else: Follower(group, layout, train_step, ...).run()    # until the leader says stop
(launch/cluster/learner_group.py: `LearnerProcesses.lead` / `.follow` wire them into a run.)
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
from typing import Any

import numpy as np

ENV_COORDINATOR = "CADENCE_COORDINATOR"
ENV_NUM_PROCESSES = "CADENCE_NUM_PROCESSES"
ENV_PROCESS_ID = "CADENCE_PROCESS_ID"
# the address this learner process serves its pieces of the weights on, set by a launcher that
# knows each host's (cadence launch ray); without it, actors.listen's host (launch/cluster/learner_group.py)
ENV_WEIGHTS_HOST = "CADENCE_WEIGHTS_HOST"

# dtypes that cross the channel (raw bytes; nothing is unpickled)
_DTYPES = {"bool", "int8", "uint8", "int32", "uint32", "int64", "float32", "float64"}
_MIN_WORDS = 256


@dataclasses.dataclass(frozen=True)
class Group:
    """This process's place in the learner group."""

    process_id: int = 0
    num_processes: int = 1

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1


def _setting(value, env: str, default):
    """A config value, else the environment's, else default (config wins: it was written on purpose)."""
    if value not in ("", 0, -1, None):
        return value
    raw = os.environ.get(env, "")
    if raw == "":
        return default
    return type(default)(raw) if default is not None else raw


def join(cfg) -> Group:
    """Joins the jax.distributed group that learner.distributed or the environment describes.

    Must run before anything initializes a JAX backend. No coordinator, no process count and no
    auto_detect: a one-process learner (Group(0, 1)). Raises ValueError naming the key when only
    part of the group is described.
    """
    import jax

    coordinator = _setting(cfg.coordinator, ENV_COORDINATOR, "")
    num = _setting(cfg.num_processes, ENV_NUM_PROCESSES, 0)
    pid = _setting(cfg.process_id if cfg.process_id >= 0 else None, ENV_PROCESS_ID, -1)
    if jax.distributed.is_initialized():
        return Group(jax.process_index(), jax.process_count())
    if cfg.auto_detect and not coordinator:
        jax.distributed.initialize(initialization_timeout=cfg.timeout_s)  # SLURM, TPU pods, MPI, GKE
        return Group(jax.process_index(), jax.process_count())
    if not coordinator and num <= 1:
        return Group()
    if not coordinator or num < 1 or pid < 0:
        raise ValueError(
            "learner.distributed: a learner group needs coordinator, num_processes and process_id "
            f"(config or ${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID}); got "
            f"coordinator={coordinator!r}, num_processes={num}, process_id={pid}")
    if pid >= num:
        raise ValueError(f"learner.distributed.process_id: {pid} must be < num_processes ({num})")
    # The coordination service listens where it is told: the coordinator's own address unless
    # bind_address widens it (it does not authenticate peers).
    bind = cfg.bind_address or coordinator
    jax.distributed.initialize(coordinator, num, pid, coordinator_bind_address=bind,
                               initialization_timeout=cfg.timeout_s,
                               shutdown_timeout_seconds=min(cfg.timeout_s, 60))
    return Group(jax.process_index(), jax.process_count())


# ---- wire format: one int32 vector per command ------------------------------------------------


def encode(command: str, meta: dict, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """(command, JSON-able meta, named arrays) -> int32 words: [header length][JSON][array bytes]."""
    specs, chunks, offset = [], [], 0
    for name, value in arrays.items():
        value = np.asarray(value)  # (ascontiguousarray would make a 0-d array 1-d)
        if value.dtype.name not in _DTYPES:
            raise TypeError(f"channel: array {name!r} has dtype {value.dtype} (allowed: {sorted(_DTYPES)})")
        raw = value.tobytes(order="C")
        specs.append([name, value.dtype.name, list(value.shape), offset])
        chunks.append(raw + b"\0" * (-len(raw) % 4))
        offset += len(chunks[-1])
    header = json.dumps({"command": command, "meta": meta, "arrays": specs}).encode()
    header += b" " * (-len(header) % 4)
    return np.frombuffer(struct.pack("<i", len(header)) + header + b"".join(chunks), np.int32).copy()


def decode(words: np.ndarray) -> tuple[str, dict, dict[str, np.ndarray]]:
    raw = np.ascontiguousarray(words, np.int32).tobytes()
    (n,) = struct.unpack_from("<i", raw)
    head = json.loads(raw[4 : 4 + n])
    body = memoryview(raw)[4 + n :]
    arrays = {}
    for name, dtype, shape, offset in head["arrays"]:
        if dtype not in _DTYPES:
            raise ValueError(f"channel: array {name!r} with dtype {dtype!r}")
        count = int(np.prod(shape, dtype=np.int64))
        arrays[name] = np.frombuffer(body, np.dtype(dtype), count, offset).reshape(shape).copy()
    return head["command"], head["meta"], arrays


def _bucket(words: int) -> int:
    """Payload sizes are rounded up to powers of two: few broadcast shapes, few compilations."""
    return max(_MIN_WORDS, 1 << (int(words) - 1).bit_length())


class Channel:
    """Process 0 -> all processes, one command at a time (jax.experimental.multihost_utils).

    Two broadcasts per command: the payload's length, then the payload padded to a power of two.
    A command may carry a part for each process (`parts`): its lengths ride in the broadcast
    header, then one device transfer moves each follower's part from process 0 to that follower
    alone (a collective permute per follower), so no process receives another's part.
    Every process must call send (process 0) or receive (the others) in the same order.
    received_bytes counts what this process received (padding included).
    """

    def __init__(self, group: Group):
        self.group = group
        self.commands = 0
        self.received_bytes = 0
        self.last_bytes = 0  # of the last command received

    def send(self, command: str, meta: dict | None = None, arrays: dict[str, np.ndarray] | None = None,
             parts: list[dict[str, np.ndarray]] | None = None) -> None:
        """parts: one dict of arrays per process; process i's followers receive parts[i] as the
        command's arrays (parts[0] stays here: process 0 uses it itself)."""
        assert self.group.is_leader, "only process 0 sends"
        meta = dict(meta or {})
        encoded = None
        if parts is not None:
            if len(parts) != self.group.num_processes:
                raise ValueError(f"channel: {len(parts)} parts for {self.group.num_processes} processes")
            encoded = [np.zeros(0, np.int32)] + [encode("part", {}, part) for part in parts[1:]]
            meta["_parts"] = [len(w) for w in encoded]
        words = encode(command, meta, arrays or {})
        self._broadcast(np.asarray([len(words)], np.int32))
        padded = np.zeros(_bucket(len(words)), np.int32)
        padded[: len(words)] = words
        self._broadcast(padded)
        if encoded is not None:
            width = _bucket(max(meta["_parts"]))
            block = np.zeros((1, len(encoded), width), np.int32)
            for i, w in enumerate(encoded):
                block[0, i, : len(w)] = w
            _scatter(block)
        self.commands += 1

    def receive(self) -> tuple[str, dict, dict[str, np.ndarray]]:
        """(command, meta, arrays): the broadcast arrays, or with parts this process's part."""
        before = self.received_bytes
        (n,) = self._broadcast(np.zeros(1, np.int32))
        words = self._broadcast(np.zeros(_bucket(int(n)), np.int32))
        self.commands += 1
        command, meta, arrays = decode(words[: int(n)])
        lengths = meta.pop("_parts", None)
        if lengths is not None:
            width = _bucket(max(lengths))
            mine = _scatter(np.zeros((1, len(lengths), width), np.int32))
            self.received_bytes += mine.nbytes
            _, _, arrays = decode(mine[: lengths[self.group.process_id]])
        self.last_bytes = self.received_bytes - before
        return command, meta, arrays

    def _broadcast(self, x: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        out = np.asarray(multihost_utils.broadcast_one_to_all(x))
        if not self.group.is_leader:
            self.received_bytes += out.nbytes
        return out


def _scatter(block: np.ndarray) -> np.ndarray:
    """block [1, processes, width] int32 (process 0: row i for process i; the others: zeros) ->
    this process's row, [width]: moved from process 0 to each follower by its own collective
    permute over a mesh of one device per process."""
    import jax

    mesh = _process_mesh()
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("processes"))
    device = mesh.devices[jax.process_index()]
    local = jax.device_put(block, device)
    x = jax.make_array_from_single_device_arrays((mesh.size, *block.shape[1:]), sharding, [local])
    out = _permute_fn(mesh)(x)
    return np.asarray(out.addressable_data(0))[0]


@functools.lru_cache(maxsize=1)
def _process_mesh():
    import jax

    first = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        first.setdefault(d.process_index, d)
    return jax.sharding.Mesh(np.asarray([first[p] for p in sorted(first)]), ("processes",))


@functools.lru_cache(maxsize=4)
def _permute_fn(mesh):
    import jax
    from jax.sharding import PartitionSpec as P

    n = mesh.size

    def body(x):  # x: [1, n, width], this process's block
        out = jax.numpy.zeros_like(x[:, 0])
        for k in range(1, n):  # process 0's row k to process k only
            out = out + jax.lax.ppermute(x[:, k], "processes", perm=[(0, k)])
        return out

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("processes"), out_specs=P("processes")))


def microbatch_arrays(microbatches) -> dict[str, np.ndarray]:
    """Host microbatches as named arrays: field i of microbatch k is "k.i" (None fields left out)."""
    out = {}
    for k, mb in enumerate(microbatches):
        for i, field in enumerate(mb):
            if field is not None:
                out[f"{k}.{i}"] = np.asarray(field)
    return out


def microbatches_from(arrays: dict[str, np.ndarray]) -> list:
    from cadence.learner.batching import Microbatch

    count = 1 + max((int(key.split(".")[0]) for key in arrays), default=-1)
    width = len(Microbatch._fields)
    return [Microbatch(*(arrays.get(f"{k}.{i}") for i in range(width))) for k in range(count)]


def as_host(x: Any) -> Any:
    """JSON-able host value (floats and ints of NumPy scalars become Python ones)."""
    return x.item() if isinstance(x, np.generic) else x
