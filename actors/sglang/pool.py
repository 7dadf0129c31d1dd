"""The SGLang servers behind one engine: routing, health and recovery, on one event loop.

ServerPool is one of SGLangEngine's parts (engine.py): it owns the servers (Server below), the
asyncio loop in a background thread that drives every request to them, and the newest exported
checkpoint (Exports, what a restarted server loads). The engine's WeightSync method (weight_sync/)
is given to it for the two moments a method decides: a server restarted after a failure, and an
attached server that answers again.

  routing     pick: the ready server with the fewest requests in flight
  health      _heartbeat_loop: GET /health on idle servers; three misses take one out of rotation;
              an attached server that answers again rejoins (weight_sync.rejoin)
  recovery    mark_down / _recover: out of rotation, and an owned server is restarted on the
              newest exported weights before it serves again; drain waits out running requests
"""
from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from cadence.actors.config import SGLangConfig
from cadence.actors.sglang.client import SGLangClient
from cadence.actors.sglang.results import EngineStats, SGLangError
from cadence.actors.sglang.server import ServerProcess

if TYPE_CHECKING:
    from cadence.actors.sglang.weight_sync import WeightSync


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


class Exports:
    """The newest checkpoint exported for the servers: the one a (re)started server loads."""

    def __init__(self, export_fn: Callable[[Any, str], Any], work_dir: str):
        """export_fn(params, dir) writes a checkpoint the servers can load; versions go in work_dir."""
        self.export_fn, self.work_dir = export_fn, work_dir
        self.model_dir: str | None = None
        self.model_version: int | None = None

    def write(self, params, version: int) -> str:
        """Writes version's checkpoint, removes the previous one; returns its directory."""
        out_dir = os.path.join(self.work_dir, f"v{version:06d}")
        self.export_fn(params, out_dir)
        old, self.model_dir, self.model_version = self.model_dir, out_dir, version
        if old and old != out_dir:
            shutil.rmtree(old, ignore_errors=True)
        return out_dir


class ServerPool:
    """Routing, health and recovery of one engine's servers (a part of SGLangEngine)."""

    def __init__(self, cfg: SGLangConfig, work_dir: str, stats: EngineStats, exports: Exports,
                 weight_sync: WeightSync):
        """Attaches cfg.urls, or prepares cfg.num_servers launched servers (started by the first
        weight sync); stats: the engine's counters; weight_sync: the method the engine syncs with."""
        self.cfg, self.stats, self.exports, self.weight_sync = cfg, stats, exports, weight_sync
        self.sync_lock = threading.Lock()  # held by a weight sync (the heartbeat leaves servers alone then)
        if cfg.urls:
            self.servers = [Server(SGLangClient(u, cfg.request_timeout_s, cfg.concurrency), None)
                            for u in cfg.urls]
        else:
            python = cfg.resolved_python()
            if not python:
                raise ValueError("launch_python: set it or $CADENCE_SGLANG_PYTHON (or attach servers with urls)")
            procs = [ServerProcess(python, cfg.launch_module, cfg.launch_args, cfg.host,
                                   cfg.port + i if cfg.port else 0, os.path.join(work_dir, "logs"),
                                   server_env(cfg, work_dir)) for i in range(cfg.num_servers)]
            self.servers = [Server(SGLangClient(p.url, cfg.request_timeout_s, cfg.concurrency), p)
                            for p in procs]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-engine", daemon=True)
        self._thread.start()
        self.slots = self.call(self._make_semaphores())  # per server: at most cfg.concurrency requests
        self._heartbeat = asyncio.run_coroutine_threadsafe(self._heartbeat_loop(), self._loop)

    def call(self, coro, timeout: float | None = None):
        """Runs coro on the pool's event loop and waits for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _make_semaphores(self):
        return [asyncio.Semaphore(self.cfg.concurrency) for _ in self.servers]

    def close(self) -> None:
        """Stops the heartbeat, the owned servers and the event loop."""
        self._heartbeat.cancel()

        async def shutdown():
            for s in self.servers:
                await s.client.close()

        try:
            self.call(shutdown(), timeout=10)
        finally:
            for s in self.servers:
                if s.process is not None:
                    s.process.stop()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    @property
    def served_version(self) -> int | None:
        """The oldest version any server that is not down holds (None before the first sync)."""
        versions = [s.version for s in self.servers if not s.down]
        return None if not versions or any(v is None for v in versions) else min(versions)

    async def pick(self) -> int:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            ready = [i for i, s in enumerate(self.servers) if s.ready]
            if ready:
                return min(ready, key=lambda i: self.servers[i].in_flight)
            if time.monotonic() > deadline:
                raise SGLangError(f"no SGLang server ready after {self.cfg.startup_timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def drain(self, server: Server) -> None:
        """Out of rotation; wait until its running requests finish (under the old version)."""
        server.ready = False
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while server.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def restart(self, server: Server, model_dir: str, version: int) -> None:
        """(Re)starts an owned server on model_dir; back in rotation serving ``version``."""
        server.ready = False
        await server.client.close()  # connections to the old process are dead anyway
        proc = server.process
        if proc.alive() or proc.proc is not None:
            await asyncio.to_thread(proc.restart, model_dir)
        else:
            await asyncio.to_thread(proc.start, model_dir)
        await asyncio.to_thread(proc.wait_healthy, self.cfg.startup_timeout_s)
        server.version, server.ready, server.failed_heartbeats, server.down = version, True, 0, False

    async def reachable(self) -> tuple[int, ...]:
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
                self.mark_down(server)  # back through the heartbeat (attached) or a restart (owned)
        return tuple(i for i, up in zip(candidates, ok) if up)

    # -- failures ---------------------------------------------------------------------------------
    def mark_down(self, server: Server) -> None:
        """Out of rotation; an owned server is restarted on the newest weights."""
        server.ready, server.down = False, True
        if server.process is not None and server.recovering is None and self.exports.model_dir is not None:
            server.recovering = asyncio.ensure_future(self._recover(server))

    async def _recover(self, server: Server) -> None:
        try:
            if server.process.alive() and await server.client.health_generate(timeout_s=self.cfg.request_timeout_s):
                server.ready = not server.awaiting_weights  # a dropped connection, not a dead server
                server.down = False
                return
            while True:
                model_dir, version = self.exports.model_dir, self.exports.model_version
                try:
                    await self.restart(server, model_dir, version)
                except Exception:  # noqa: BLE001 - a failed start is retried after a pause
                    await asyncio.sleep(self.cfg.backoff_s)
                    continue
                self.stats.restarts += 1
                if self.weight_sync.restarted(server, version):
                    return  # its method keeps it out of rotation until the next sync
                if self.exports.model_version == version:
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
                    self.mark_down(server)
                    continue
                if server.ready and server.in_flight == 0:
                    # GET /health, not /health_generate: sglang-jax 0.1.0rc0's scheduler crashed when
                    # its generation shared a decode batch with return_logprob requests.
                    ok = await server.client.health(timeout_s=self.cfg.request_timeout_s)
                    server.failed_heartbeats = 0 if ok else server.failed_heartbeats + 1
                    if server.failed_heartbeats >= 3:
                        self.mark_down(server)
                elif not server.ready and server.process is None and not self.sync_lock.locked():
                    # An attached server back from the dead rejoins once it answers, as its
                    # method says (disk: after loading the newest weights).
                    if await server.client.health_generate(timeout_s=self.cfg.request_timeout_s):
                        await self.weight_sync.rejoin(self, server)
