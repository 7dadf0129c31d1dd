"""Distributed weight sync (sync="distributed"): the learner broadcasts its weights to SGLang servers.

    group = UpdateGroup("nccl", "10.0.0.2", 0, world_size=1 + 8, group_name="cadence-1", timeout_s=300)
    # meanwhile every server POSTs ... init_request(...) and joins; then:
    group.join()
    for bucket in plan_buckets(hf_tensors(model_cfg, params), 512 << 20, "bfloat16"):
        tensors = bucket_tensors(bucket, "bfloat16", "nccl")  # ... POST update_request(...) to each server, then:
        group.broadcast(tensors)

The learner is rank 0 of a torch.distributed group that every server rank joins through
/init_weights_update_group (main SGLang: rank = rank_offset + tp_rank, rendezvous through a TCP
store the learner hosts). For each bucket the learner POSTs /update_weights_from_distributed
(names, dtypes, shapes) to every server and broadcasts the tensors from rank 0 in that order; each
server allocates them, receives them and loads them by name (SGLang's
ModelRunner.update_weights_from_distributed).

JAX arrays reach torch through DLPack: on a GPU without a copy, on the learner's device. Per
bucket, linear kernels are transposed (HF stores [out, in]) and cast to the servers' dtype, so an
update holds at most two buckets of extra memory (one sent, the next being prepared).

Security: torch.distributed does not authenticate its peers. The rendezvous store listens only on
``address`` (loopback by default); NCCL and gloo open their own sockets on the interface they pick.
SGLangConfig.validate() wants dist_trusted_network=true before the address leaves loopback.
"""
from __future__ import annotations

import asyncio
import datetime
import itertools
import socket
import threading
import uuid
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from cadence.learner.models.hf_export import HFTensor, plan_shards


def _torch():
    try:
        import torch
        import torch.distributed  # noqa: F401 - the submodule is what we use
    except ImportError as e:  # torch is not a core dependency
        raise ImportError("sync: 'distributed' needs torch in the learner's environment "
                          "(pip install torch; a CUDA build for nccl)") from e
    return torch


def init_request(address: str, port: int, rank_offset: int, world_size: int, group_name: str,
                 backend: str) -> dict:
    """The /init_weights_update_group payload for one server (its ranks start at rank_offset)."""
    return {"master_address": address, "master_port": int(port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def update_request(tensors: Sequence, group_name: str, *, version: int | None = None,
                   flush_cache: bool = False) -> dict:
    """The /update_weights_from_distributed payload announcing one bucket of torch tensors.

    ``tensors`` are (name, torch.Tensor) pairs in broadcast order. version (weight_version) and
    flush_cache belong on the last bucket only: the server then serves the new weights whole.
    """
    payload = {"names": [n for n, _ in tensors],
               "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
               "shapes": [list(t.shape) for _, t in tensors],
               "group_name": group_name, "flush_cache": bool(flush_cache)}
    if version is not None:
        payload["weight_version"] = str(version)
    return payload


def sent_nbytes(t: HFTensor, dtype: str | None) -> int:
    """Bytes of t on the wire (after the cast to dtype, when given)."""
    return t.value.size * (jnp.dtype(dtype).itemsize if dtype else t.value.dtype.itemsize)


def plan_buckets(tensors: Sequence[HFTensor], bucket_bytes: int, dtype: str | None = None) -> list[list[HFTensor]]:
    """Groups tensors in order into buckets of at most bucket_bytes sent (a bigger one goes alone)."""
    by_name = {t.name: t for t in tensors}
    groups = plan_shards([(t.name, sent_nbytes(t, dtype)) for t in tensors], bucket_bytes)
    return [[by_name[n] for n in g] for g in groups if g]


def _one_device(values: list[jax.Array], gather: Callable | None) -> list[jax.Array]:
    # DLPack exports single-device arrays only: a sharded param is gathered onto one local device,
    # by `gather` when its shards live in other processes too (a collective they all join).
    if all(len(v.sharding.device_set) == 1 for v in values):
        return values
    if gather is not None:
        return list(gather(values))
    if not all(v.is_fully_addressable for v in values):
        raise ValueError("sync: 'distributed' broadcasts from one process, but a param is sharded across "
                         "hosts and no gather function was given")
    return [jax.device_put(v, jax.local_devices()[0]) for v in values]


def bucket_tensors(bucket: Sequence[HFTensor], dtype: str | None, backend: str,
                   gather: Callable | None = None) -> list:
    """(name, torch.Tensor) pairs for one bucket in HF layout: transposed kernels, cast to dtype.

    The tensors share memory with fresh JAX arrays (DLPack); nccl needs them on the GPU, so
    host arrays are copied there. A sharded learner's params are gathered a bucket at a time
    (gather: e.g. launch.learner_group.LearnerProcesses.fetch), never the whole model at once.
    """
    torch = _torch()
    out = []
    for t, value in zip(bucket, _one_device([t.value for t in bucket], gather)):
        if t.transposed:
            value = value.T
        if dtype and value.dtype != jnp.dtype(dtype):
            value = value.astype(dtype)
        tensor = torch.from_dlpack(value)
        if backend == "nccl" and not tensor.is_cuda:
            tensor = tensor.cuda()
        out.append((t.name, tensor))
    return out


class UpdateGroup:
    """The learner's side of one weight-update group (rank 0). join() once, broadcast() per bucket.

    The rendezvous store is bound at construction (so ``port`` is known before the servers are
    told it); join() blocks until every rank has joined (gloo connects there; nccl at the first
    broadcast).
    """

    def __init__(self, backend: str, address: str, port: int, world_size: int, group_name: str,
                 timeout_s: float):
        torch = _torch()
        self.backend, self.address, self.world_size, self.group_name = backend, address, world_size, group_name
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # Bind the listening socket ourselves: a TCPStore given only a port listens on every interface.
        sock = socket.create_server((address, port), backlog=max(64, world_size))
        self.port = sock.getsockname()[1]
        try:
            self._store = torch.distributed.TCPStore(address, self.port, world_size, True, timeout=self.timeout,
                                                     wait_for_workers=False, master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store owns the descriptor now and closes it when it goes
        self.pg = None

    def join(self) -> None:
        from torch.distributed import distributed_c10d as c10d
        store = c10d.PrefixStore(self.group_name, self._store)  # the servers prefix their keys the same way
        pg, _ = c10d._new_process_group_helper(self.world_size, 0, [], c10d.Backend(self.backend), store,
                                               group_name=self.group_name, timeout=self.timeout)
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(self.world_size)}  # lets broadcast(src=0) resolve
        self.pg = pg

    def broadcast(self, tensors: Sequence) -> None:
        """Sends (name, tensor) pairs from rank 0, in order; returns when every send completed."""
        torch = _torch()
        works = [torch.distributed.broadcast(t, src=0, group=self.pg, async_op=True) for _, t in tensors]
        for w in works:
            w.wait()
        if self.backend == "nccl":
            torch.cuda.synchronize()  # wait() only orders streams; the sources must outlive the sends

    def close(self) -> None:
        """Leaves the group and stops the store (idempotent)."""
        dist = _torch().distributed
        if self.pg is not None:
            try:
                dist.destroy_process_group(self.pg)
            except (RuntimeError, ValueError):  # a group whose peers died may refuse a clean shutdown
                pass
            self.pg = None
        self._store = None


class GroupConfigError(ValueError):
    """A server cannot join the way the protocol needs (several dp/pp replicas, no endpoint)."""


def in_thread(fn: Callable, *args) -> asyncio.Future:
    """Runs fn(*args) in a daemon thread; the future resolves on the calling loop.

    Not asyncio.to_thread: a torch collective whose peer died blocks until its timeout, and the
    caller must be able to give up on it (and exit) without waiting for that.
    """
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error):
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run():
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="cadence-weight-broadcast", daemon=True).start()
    return fut


async def all_or_first_error(aws: Sequence) -> list:
    """Awaits every awaitable; on the first failure cancels the rest and raises it."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    if failed:
        for t in pending:
            t.cancel()
        raise failed[0].exception()
    return [t.result() for t in tasks]


async def form_group(clients: Sequence, cfg) -> UpdateGroup:
    """A new group: the learner at rank 0, then each server's tp ranks in the order of clients.

    Raises GroupConfigError for servers with several data- or pipeline-parallel replicas (SGLang
    ranks them rank_offset + tp_rank, so they would collide); the caller's errors otherwise
    (ServerUnavailable, ServerHTTPError, RuntimeError).
    """
    infos = await asyncio.gather(*(c.server_info() for c in clients))
    sizes = []
    for c, info in zip(clients, infos):
        for key in ("dp_size", "pp_size"):
            if int(info.get(key) or 1) != 1:
                raise GroupConfigError(f"{c.base_url}: {key}={info[key]}: sync: 'distributed' needs one replica "
                                       "per server (SGLang ranks a server's weight receivers by tp_rank only)")
        sizes.append(int(info.get("tp_size") or 1))
    offsets = [1 + o for o in itertools.accumulate([0] + sizes[:-1])]
    group = UpdateGroup(cfg.dist_backend, cfg.dist_address, cfg.dist_port, 1 + sum(sizes),
                        f"cadence-{uuid.uuid4().hex[:12]}", cfg.dist_timeout_s)
    requests = [init_request(cfg.dist_address, group.port, off, group.world_size, group.group_name, cfg.dist_backend)
                for off in offsets]
    await all_or_first_error([in_thread(group.join), *(c.init_weights_update_group(r, cfg.dist_timeout_s)
                                                        for c, r in zip(clients, requests))])
    return group


async def broadcast_update(group: UpdateGroup, clients: Sequence, tensors: Sequence[HFTensor], cfg,
                           version: int, gather: Callable | None = None) -> int:
    """Sends every tensor to every server, a bucket at a time; returns the bytes sent.

    The last bucket carries weight_version and flush_cache; the next bucket is prepared while one
    is sent (at most two buckets of extra memory). A failure leaves the servers partly updated:
    the caller must not let them serve until an update succeeds.
    """
    dtype = cfg.dist_dtype or None
    buckets = plan_buckets(tensors, int(cfg.dist_bucket_mb * (1 << 20)), dtype)
    sent = 0
    ready = in_thread(bucket_tensors, buckets[0], dtype, cfg.dist_backend, gather)
    for k in range(len(buckets)):
        pairs = await ready
        last = k == len(buckets) - 1
        if not last:  # the next bucket's transposes and casts overlap this one's transfer
            ready = in_thread(bucket_tensors, buckets[k + 1], dtype, cfg.dist_backend, gather)
        payload = update_request(pairs, group.group_name, version=version if last else None, flush_cache=last)
        await all_or_first_error([in_thread(group.broadcast, pairs),
                                  *(c.update_weights_from_distributed(payload, cfg.dist_timeout_s) for c in clients)])
        sent += sum(t.numel() * t.element_size() for _, t in pairs)
    return sent

