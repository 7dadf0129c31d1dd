"""Weight sync of the SGLang servers, three kinds: restart, disk and distributed.

WeightSync is one of SGLangEngine's parts (engine.py); it never changes a server under a running
request: the server leaves the rotation (ServerPool._drain), its requests finish under the old
version, then it
  restart      restarts on the newly exported checkpoint (sglang-jax: no update endpoint)
  disk         loads it with /update_weights_from_disk (main SGLang)
  distributed  receives a torch.distributed broadcast from the learner (weight_broadcast.py); every
               server at once, since they share one group; launched servers start from an
               exported checkpoint, and one restarted after a failure waits out of rotation until
               the next sync broadcasts the newest weights to it.
State it keeps on the engine: model_dir / model_version (newest export), synced_version, _group
and _group_members (the distributed group), and each server's version.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time

from cadence.actors.sglang.alignment import MalformedResponse
from cadence.actors.sglang.client import ServerHTTPError, ServerUnavailable
from cadence.actors.sglang.pool import Server
from cadence.actors.sglang.results import SGLangError
from cadence.actors.sglang.weight_broadcast import GroupConfigError, broadcast_update, form_group


class WeightSync:
    """Brings the engine's servers to a new weights version (a part of SGLangEngine)."""

    def needs_sync(self, version: int, min_version: int | None = None) -> bool:
        """Would sync_weights(…, version, min_version) change the servers?"""
        served = self.served_version
        if served is None or any(s.awaiting_weights for s in self.servers):
            return True
        if served >= version:
            return False
        if min_version is not None and served < min_version:
            return True
        if self.cfg.sync_every and version - served >= self.cfg.sync_every:
            return True
        return min_version is None

    def forget_weights(self) -> None:
        """The learner restarted, and its resumed run may be older than what the servers hold: the
        next sync_weights() brings every server to the version it is given, whatever it held."""
        with self._sync_lock:
            for s in self.servers:
                s.version = None

    def sync_weights(self, params, version: int, min_version: int | None = None) -> bool:
        """Brings every server to ``version`` when needed; returns whether it synced.

        Needed when: nothing is served yet; a server holds a version older than min_version (the
        oldest the admission gate still accepts for the caller's samples); the lag reached
        cfg.sync_every; or min_version is None (always sync to the newest). Blocks until done; other
        actors' requests meanwhile finish under the old version or wait for the new one.
        """
        with self._sync_lock:
            if not self.needs_sync(version, min_version):
                return False
            t0 = time.perf_counter()
            if self.cfg.sync == "distributed":
                if not self._sync_distributed(params, version):
                    return False  # only a server still down was waiting
            else:
                self._export(params, version)
                self._call(self._sync_all(self.model_dir, version))
            self.synced_version = version
            self.stats.syncs += 1
            self.stats.sync_seconds += time.perf_counter() - t0
            return True

    def _export(self, params, version: int) -> None:
        """Writes version's checkpoint (the one restarts load) and removes the previous one."""
        out_dir = os.path.join(self.work_dir, f"v{version:06d}")
        self.export_fn(params, out_dir)
        old, self.model_dir, self.model_version = self.model_dir, out_dir, version
        if old and old != out_dir:
            shutil.rmtree(old, ignore_errors=True)

    def _sync_distributed(self, params, version: int) -> bool:
        """Starts launched servers on a first export, then broadcasts; False when nothing changed."""
        unstarted = [s for s in self.servers if s.process is not None and s.version is None and s.recovering is None]
        if unstarted:  # launched servers start from a checkpoint on disk; later versions arrive by broadcast
            self._export(params, version)
            self._call(self._start_all(unstarted, self.model_dir, version))
        return self._call(self._broadcast(params, version)) or bool(unstarted)

    async def _start_all(self, servers: list[Server], model_dir: str, version: int) -> None:
        await asyncio.gather(*(self._restart(s, model_dir, version) for s in servers))

    async def _leave_group(self, failed: bool = False) -> None:
        """Best effort: the members drop the group, then the learner does.

        After a failure (or when a member does not answer) the learner's side is only dropped: a
        broadcast thread may still wait inside it on a dead peer, until dist_timeout_s.
        """
        group, members, self._group, self._group_members = self._group, self._group_members, None, ()
        if group is None:
            return
        results = await asyncio.gather(*(self.servers[i].client.destroy_weights_update_group(group.group_name)
                                         for i in members), return_exceptions=True)
        if not failed and not any(isinstance(r, BaseException) for r in results):
            group.close()

    async def _broadcast(self, params, version: int) -> bool:
        """Every reachable server to ``version`` through one group (retried on a failure); False
        when all of them already held it."""
        failures = 0
        while True:
            members = await self._reachable()
            if not members:
                raise SGLangError(f"weight sync to version {version}: no SGLang server answers /health")
            servers = [self.servers[i] for i in members]
            if all(s.version == version and not s.awaiting_weights for s in servers):
                return False
            await asyncio.gather(*(self._drain(s) for s in servers))
            clients = [s.client for s in servers]
            try:
                if self._group is None or self._group_members != members:
                    await self._leave_group()
                    self._group = await form_group(clients, self.cfg)
                    self._group_members = members
                self.stats.sync_bytes += await broadcast_update(self._group, clients, self.tensors_fn(params),
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
            self.stats.sync_failures += 1
            failures += 1
            for s in servers:
                s.awaiting_weights = True
            await self._leave_group(failed=True)
            if failures > self.cfg.retries:
                raise SGLangError(f"weight sync to version {version} failed {failures} times; last: "
                                  f"{type(error).__name__}: {error}") from error
            await asyncio.sleep(self.cfg.backoff_s * 2 ** (failures - 1))

    async def _sync_all(self, model_dir: str, version: int) -> None:
        await asyncio.gather(*(self._sync_one(i, model_dir, version) for i in range(len(self.servers))))
        if not any(s.ready or s.recovering is not None for s in self.servers):
            raise SGLangError(f"weight sync to version {version}: no SGLang server answered")

    async def _sync_one(self, i: int, model_dir: str, version: int) -> None:
        server = self.servers[i]
        if server.recovering is not None:  # a restart in progress picks up the new model_dir itself
            await asyncio.shield(server.recovering)
            if server.version == version:
                return
        await self._drain(server)
        if self.cfg.sync == "restart":
            await self._restart(server, model_dir, version)
        else:
            try:
                await server.client.update_weights_from_disk(model_dir, version)
            except ServerUnavailable:  # dead: out of rotation; the heartbeat loads the newest when it is back
                self._mark_down(server)
                return
            server.version, server.ready, server.down = version, True, False
