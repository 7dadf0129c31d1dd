"""The SGLang servers behind one engine: routing, health and recovery.

ServerPool is one of SGLangEngine's parts (engine.py composes it with WeightSync); its methods run
on the engine's event loop and use the engine's state: servers (Server below), cfg, stats,
_sync_lock, and the newest weights (model_dir, model_version, synced_version) that WeightSync keeps.

  routing     _pick: the ready server with the fewest requests in flight
  health      _heartbeat_loop: GET /health on idle servers; three misses take one out of rotation;
              an attached server that answers again rejoins (with the newest weights)
  recovery    _mark_down / _recover: out of rotation, and an owned server is restarted on the
              newest exported weights before it serves again; _drain waits out running requests
"""
from __future__ import annotations

import asyncio
import os
import time

from cadence.actors.config import SGLangConfig
from cadence.actors.sglang.client import ServerHTTPError, ServerUnavailable, SGLangClient
from cadence.actors.sglang.results import SGLangError
from cadence.actors.sglang.server import ServerProcess


def server_env(cfg: SGLangConfig, work_dir: str) -> tuple[str, ...]:
    """launch_env, plus a JAX compilation cache in work_dir shared by launched servers (compile_cache).

    A restart (sglang-jax's weight sync) then loads the compiled programs instead of rebuilding them:
    measured on 2 CPU cores, the tiny test server's start went from 22 s to 13 s. Entries the user
    set in launch_env win.
    """
    env = tuple(cfg.launch_env)
    if cfg.compile_cache and not any(e.startswith("JAX_COMPILATION_CACHE_DIR=") for e in env):
        env += (f"JAX_COMPILATION_CACHE_DIR={os.path.join(work_dir, 'jax-cache')}",
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0")
    return env


class Server:
    def __init__(self, client: SGLangClient, process: ServerProcess | None):
        self.client, self.process = client, process
        self.version: int | None = None  # weights it serves (None: unknown / not started)
        self.ready = False  # in rotation
        self.in_flight = 0
        self.recovering: asyncio.Task | None = None
        self.failed_heartbeats = 0
        self.awaiting_weights = False  # distributed sync: up, but must get the newest weights before it serves
        self.down = False  # did not answer; left out of served_version until it serves again


class ServerPool:
    """Routing, health and recovery of the engine's servers (a part of SGLangEngine)."""

    @property
    def served_version(self) -> int | None:
        """The oldest version any server that is not down holds (None before the first sync)."""
        versions = [s.version for s in self.servers if not s.down]
        return None if not versions or any(v is None for v in versions) else min(versions)

    async def _pick(self) -> int:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            ready = [i for i, s in enumerate(self.servers) if s.ready]
            if ready:
                return min(ready, key=lambda i: self.servers[i].in_flight)
            if time.monotonic() > deadline:
                raise SGLangError(f"no SGLang server ready after {self.cfg.startup_timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def _drain(self, server: Server) -> None:
        """Out of rotation; wait until its running requests finish (under the old version)."""
        server.ready = False
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while server.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def _restart(self, server: Server, model_dir: str, version: int) -> None:
        server.ready = False
        await server.client.close()  # connections to the old process are dead anyway
        proc = server.process
        if proc.alive() or proc.proc is not None:
            await asyncio.to_thread(proc.restart, model_dir)
        else:
            await asyncio.to_thread(proc.start, model_dir)
        await asyncio.to_thread(proc.wait_healthy, self.cfg.startup_timeout_s)
        server.version, server.ready, server.failed_heartbeats, server.down = version, True, 0, False

    async def _reachable(self) -> tuple[int, ...]:
        """Servers that answer /health and are not being restarted (the members of a new group)."""
        candidates = [i for i, s in enumerate(self.servers) if s.recovering is None
                      and (s.process is None or s.process.alive())]
        ok = await asyncio.gather(*(self.servers[i].client.health(timeout_s=self.cfg.request_timeout_s)
                                    for i in candidates))
        for i, up in zip(candidates, ok):
            if not up:
                server = self.servers[i]
                if server.process is None:
                    # Not waited for while down (no health check per sync); the heartbeat sets it
                    # waiting again when the server answers. An owned one keeps the flag: its recovery
                    # must not put partly updated weights back in rotation.
                    server.awaiting_weights = False
                self._mark_down(server)  # back through the heartbeat (attached) or a restart (owned)
        return tuple(i for i, up in zip(candidates, ok) if up)

    # -- failures ---------------------------------------------------------------------------------
    def _mark_down(self, server: Server) -> None:
        """Out of rotation; an owned server is restarted on the newest weights."""
        server.ready, server.down = False, True
        if server.process is not None and server.recovering is None and self.model_dir is not None:
            server.recovering = asyncio.ensure_future(self._recover(server))

    async def _recover(self, server: Server) -> None:
        try:
            if server.process.alive() and await server.client.health_generate(timeout_s=self.cfg.request_timeout_s):
                server.ready = not server.awaiting_weights  # a dropped connection, not a dead server
                server.down = False
                return
            while True:
                model_dir, version = self.model_dir, self.model_version
                try:
                    await self._restart(server, model_dir, version)
                except Exception:  # noqa: BLE001 - a failed start is retried after a pause
                    await asyncio.sleep(self.cfg.backoff_s)
                    continue
                self.stats.restarts += 1
                if self.cfg.sync == "distributed" and self.synced_version != version:
                    # Restarted on the launch checkpoint: the next sync_weights() broadcasts the newest.
                    # Not down: its old version must count until then.
                    server.ready, server.awaiting_weights = False, True
                    return
                if self.model_version == version:
                    return
                # A sync happened while it restarted: bring it to the newest before it serves.
        finally:
            server.recovering = None

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            for server in self.servers:
                if server.recovering is not None or server.version is None:
                    continue
                if server.process is not None and not server.process.alive():
                    self._mark_down(server)
                    continue
                if server.ready and server.in_flight == 0:
                    # GET /health, not /health_generate: sglang-jax 0.1.0rc0's scheduler crashed when
                    # its generation shared a decode batch with return_logprob requests.
                    ok = await server.client.health(timeout_s=self.cfg.request_timeout_s)
                    server.failed_heartbeats = 0 if ok else server.failed_heartbeats + 1
                    if server.failed_heartbeats >= 3:
                        self._mark_down(server)
                elif not server.ready and server.process is None and not self._sync_lock.locked():
                    # An attached server back from the dead rejoins once it answers (disk mode:
                    # after loading the newest weights).
                    if await server.client.health_generate(timeout_s=self.cfg.request_timeout_s):
                        if self.cfg.sync == "distributed":
                            server.awaiting_weights = self.synced_version is not None
                            server.ready, server.down = not server.awaiting_weights, False
                            continue
                        if self.cfg.sync == "disk" and self.model_dir and server.version != self.model_version:
                            try:
                                await server.client.update_weights_from_disk(self.model_dir, self.model_version)
                                server.version = self.model_version
                            except (ServerUnavailable, ServerHTTPError, RuntimeError):
                                continue
                        server.ready, server.down = True, False
