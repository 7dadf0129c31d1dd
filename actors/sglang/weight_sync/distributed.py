"""sync="distributed": the learner broadcasts its weights to every server at once through one
torch.distributed group (weight_broadcast.py; main SGLang's weight-update endpoints).

Launched servers start from an exported checkpoint; later versions arrive by broadcast, so a server
restarted after a failure (on that older checkpoint) waits out of rotation until the next update
broadcasts the newest weights to it, and so does an attached server that answers again. A failed
broadcast leaves its partly updated servers waiting too; the group is formed again when its members
change (a server died or came back).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Callable

from cadence.actors.config import SGLangConfig, is_loopback
from cadence.actors.sglang.alignment import MalformedResponse
from cadence.actors.sglang.results import ServerHTTPError, ServerUnavailable, SGLangError
from cadence.actors.sglang.weight_broadcast import GroupConfigError, broadcast_update, form_group
from cadence.actors.sglang.weight_sync.base import WeightSync

if TYPE_CHECKING:
    from cadence.actors.sglang.pool import Server, ServerPool


class DistributedSync(WeightSync):
    method = "distributed"

    def __init__(self, cfg: SGLangConfig, exports, *, tensors_fn=None, gather_fn=None):
        if tensors_fn is None:
            raise ValueError("sync: 'distributed' needs the engine's tensors_fn (params -> hf_export.hf_tensors)")
        super().__init__(cfg, exports, tensors_fn=tensors_fn, gather_fn=gather_fn)
        self.group = None  # the weight-update group (weight_broadcast.UpdateGroup), and its members
        self.members: tuple[int, ...] = ()  # indices into pool.servers
        self.synced_version: int | None = None  # newest version an update brought the servers to

    @classmethod
    def check_config(cls, cfg: SGLangConfig) -> None:
        if not cfg.dist_trusted_network and not is_loopback(cfg.dist_address):
            raise ValueError(f"dist_address: {cfg.dist_address!r} is not loopback, and torch.distributed does not "
                             "authenticate its peers; on a trusted private network set dist_trusted_network=true")

    @classmethod
    def for_actor_process(cls, cfg: SGLangConfig, log: Callable[[str], None]) -> SGLangConfig:
        if not cfg.urls and is_loopback(cfg.host):
            # rank 0 is this process, its servers are here: not the learner's address
            return dataclasses.replace(cfg, dist_address="127.0.0.1")
        return cfg

    def update(self, pool: ServerPool, params, version: int) -> bool:
        """Starts launched servers on a first export, then broadcasts."""
        unstarted = [s for s in pool.servers if s.process is not None and s.version is None and s.recovering is None]
        if unstarted:  # launched servers start from a checkpoint on disk; later versions arrive by broadcast
            model_dir = self.exports.write(params, version)
            pool.call(self._start_all(pool, unstarted, model_dir, version))
        changed = pool.call(self._broadcast(pool, params, version)) or bool(unstarted)
        if changed:
            self.synced_version = version
        return changed

    @staticmethod
    async def _start_all(pool: ServerPool, servers: list[Server], model_dir: str, version: int) -> None:
        await asyncio.gather(*(pool.restart(s, model_dir, version) for s in servers))

    def restarted(self, server: Server, version: int) -> bool:
        if self.synced_version == version:
            return False
        # Restarted on the launch checkpoint: the next update broadcasts the newest. Not down: its old
        # version must count until then.
        server.ready, server.awaiting_weights = False, True
        return True

    async def rejoin(self, pool: ServerPool, server: Server) -> None:
        server.awaiting_weights = self.synced_version is not None
        server.ready, server.down = not server.awaiting_weights, False

    async def _leave_group(self, pool: ServerPool, failed: bool = False) -> None:
        """Best effort: the members drop the group, then the learner does.

        After a failure (or when a member does not answer) the learner's side is only dropped: a
        broadcast thread may still wait inside it on a dead peer, until dist_timeout_s.
        """
        group, members, self.group, self.members = self.group, self.members, None, ()
        if group is None:
            return
        results = await asyncio.gather(*(pool.servers[i].client.destroy_weights_update_group(group.group_name)
                                         for i in members), return_exceptions=True)
        if not failed and not any(isinstance(r, BaseException) for r in results):
            group.close()

    async def _broadcast(self, pool: ServerPool, params, version: int) -> bool:
        """Every reachable server to ``version`` through one group (retried on a failure); False
        when all of them already held it."""
        failures = 0
        while True:
            members = await pool.reachable()
            if not members:
                raise SGLangError(f"weight sync to version {version}: no SGLang server answers /health")
            servers = [pool.servers[i] for i in members]
            if all(s.version == version and not s.awaiting_weights for s in servers):
                return False
            await asyncio.gather(*(pool.drain(s) for s in servers))
            clients = [s.client for s in servers]
            try:
                if self.group is None or self.members != members:
                    await self._leave_group(pool)
                    self.group = await form_group(clients, self.cfg)
                    self.members = members
                pool.stats.sync_bytes += await broadcast_update(self.group, clients, self.tensors_fn(params),
                                                                self.cfg, version, gather=self.gather_fn)
            except GroupConfigError as e:
                raise SGLangError(str(e)) from e
            except ServerHTTPError as e:
                if e.status == 404:
                    raise SGLangError(f"{e} : sync: 'distributed' needs main SGLang's weight-update endpoints "
                                      "(sglang-jax has none: use sync: 'restart')") from e
                error = e
            except (ServerUnavailable, MalformedResponse, RuntimeError, OSError, asyncio.TimeoutError) as e:
                error = e  # torch's collective errors are RuntimeErrors
            else:
                for s in servers:
                    s.version, s.awaiting_weights, s.ready, s.down = version, False, True, False
                return True
            # Partly updated servers must not serve: they wait for the next successful update.
            pool.stats.sync_failures += 1
            failures += 1
            for s in servers:
                s.awaiting_weights = True
            await self._leave_group(pool, failed=True)
            if failures > self.cfg.retries:
                raise SGLangError(f"weight sync to version {version} failed {failures} times; last: "
                                  f"{type(error).__name__}: {error}") from error
            await asyncio.sleep(self.cfg.backoff_s * 2 ** (failures - 1))
