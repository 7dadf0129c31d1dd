"""SGLangEngine: SGLang servers behind the built-in engine's generate() contract, plus weight sync.

    engine = SGLangEngine(cfg.actors.sglang, max_new_tokens=8, eos_id=2, pad_id=0,
                          export_fn=lambda params, d: export_for_server(model_cfg, params, d),
                          work_dir="/run/sglang")
    engine.sync_weights(params, version)            # start / bring servers to this version
    result = engine.generate(params, prompts, key)  # SGLangResult, one row per prompt

One asyncio loop in a background thread drives every server; generate() may be called from several
actor threads at once. Each row is one /generate request (input_ids, return_logprob) sent to the
ready server with the fewest requests in flight, at most ``concurrency`` per server. A response
that does not align (alignment.py) or is not JSON is counted and re-issued; a server that does not
answer is taken out of rotation, its requests re-issued elsewhere (or after its restart), and a
server Cadence owns is restarted on the newest exported weights before it serves again.

Versions: every row records the version its server held when the request was sent
(``policy_versions``). Weight sync never changes a server under a running request: the server
leaves the rotation, its requests finish under the old version, then it restarts (sync="restart",
sglang-jax), loads from disk (sync="disk", main sglang's /update_weights_from_disk) or receives a
torch.distributed broadcast from the learner (sync="distributed", weight_broadcast.py; every
server at once, since they share one group). With "distributed", launched servers start from an
exported checkpoint and a server restarted after a failure waits out of rotation until the next
sync_weights() broadcasts the newest weights to it.

Behavior logprobs are the server's ``output_token_logprobs``; the comparison with Cadence's JAX
model (tests/actors/sglang_parity_test.py) states the tolerance that holds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import shutil
import threading
import time
import uuid
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from actors.config import SGLangConfig
from actors.sglang.alignment import Completion, MalformedResponse, MisalignedResponse, parse_completion
from actors.sglang.client import ServerHTTPError, ServerUnavailable, SGLangClient, completion_request
from actors.sglang.server import ServerProcess
from actors.sglang.weight_broadcast import GroupConfigError, broadcast_update, form_group


class SGLangResult(NamedTuple):
    """GenerationResult's fields (same order and meaning) plus the version of each row."""

    tokens: np.ndarray  # [N, M] int32, pad_id after the end
    logprobs: np.ndarray  # [N, M] float32 behavior logprobs (the server's), 0 after the end
    lengths: np.ndarray  # [N] int32, including the stop token
    seconds: float
    num_tokens: int
    kept_logmass: np.ndarray | None  # [N, M] zeros when top_p == 1 (no truncation); None otherwise (not reported)
    policy_versions: np.ndarray  # [N] int64: the weights version the row's server held


class GenerationAborted(RuntimeError):
    """abort() was called while this generate() call was running."""


class SGLangError(RuntimeError):
    """A request failed more than ``retries`` times, or no server became ready in time."""


@dataclasses.dataclass
class EngineStats:
    """Counters (metrics): written on the engine's event loop, read anywhere."""

    requests: int = 0  # /generate requests sent
    completions: int = 0  # rows returned
    tokens: int = 0
    reissued: int = 0  # requests sent again after a failure of any kind
    misaligned: int = 0  # responses rejected by the alignment check
    malformed: int = 0  # responses that were not the promised JSON
    unavailable: int = 0  # requests that found their server gone (refused, reset, timed out)
    http_errors: int = 0
    restarts: int = 0  # owned servers restarted after a failure
    syncs: int = 0  # weight syncs completed
    sync_seconds: float = 0.0  # total time inside sync_weights (export + restart/load/broadcast)
    sync_bytes: int = 0  # sent by distributed syncs (per server: one broadcast reaches all)
    sync_failures: int = 0  # distributed sync attempts that failed and were retried or raised


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


class _Server:
    def __init__(self, client: SGLangClient, process: ServerProcess | None):
        self.client, self.process = client, process
        self.version: int | None = None  # weights it serves (None: unknown / not started)
        self.ready = False  # in rotation
        self.in_flight = 0
        self.recovering: asyncio.Task | None = None
        self.failed_heartbeats = 0
        self.awaiting_weights = False  # distributed sync: up, but must get the newest weights before it serves
        self.down = False  # did not answer; left out of served_version until it serves again


class SGLangEngine:
    """See the module docstring. Call close() when done (stops owned servers)."""

    name = "sglang"

    def __init__(self, cfg: SGLangConfig, *, max_new_tokens: int, eos_id: int, pad_id: int,
                 export_fn: Callable[[Any, str], Any], work_dir: str, temperature: float = 1.0,
                 top_p: float = 1.0, tensors_fn: Callable[[Any], list] | None = None,
                 gather_fn: Callable[[list], list] | None = None):
        """Args: cfg; max_new_tokens/eos_id/pad_id/temperature/top_p as for JaxEngine; export_fn(params,
        dir) writes a checkpoint the servers can load; work_dir holds exported versions and logs;
        tensors_fn(params) gives the HF tensors a distributed sync sends (hf_export.hf_tensors);
        gather_fn(arrays) -> the arrays whole on this process, a bucket at a time (a learner
        sharded over processes; default: arrays this process can read)."""
        cfg.validate()
        if cfg.sync == "distributed" and tensors_fn is None:
            raise ValueError("sync: 'distributed' needs the engine's tensors_fn (params -> hf_export.hf_tensors)")
        self.cfg = cfg
        self.tensors_fn = tensors_fn
        self.gather_fn = gather_fn
        self._group = None  # distributed sync: the weight-update group, and which servers are in it
        self._group_members: tuple[int, ...] = ()
        self.synced_version: int | None = None  # newest version a sync brought the servers to
        self.max_new_tokens, self.eos_id, self.pad_id = int(max_new_tokens), int(eos_id), int(pad_id)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.export_fn = export_fn
        self.work_dir = os.path.abspath(work_dir)
        os.makedirs(self.work_dir, exist_ok=True)
        self.stats = EngineStats()
        self.model_dir: str | None = None  # newest exported checkpoint
        self.model_version: int | None = None
        self._sync_lock = threading.Lock()
        self._abort_epoch = 0
        self._rids = itertools.count()
        if cfg.urls:
            self.servers = [_Server(SGLangClient(u, cfg.request_timeout_s, cfg.concurrency), None)
                            for u in cfg.urls]
        else:
            python = cfg.resolved_python()
            if not python:
                raise ValueError("launch_python: set it or $CADENCE_SGLANG_PYTHON (or attach servers with urls)")
            procs = [ServerProcess(python, cfg.launch_module, cfg.launch_args, cfg.host,
                                   cfg.port + i if cfg.port else 0, os.path.join(self.work_dir, "logs"),
                                   server_env(cfg, self.work_dir)) for i in range(cfg.num_servers)]
            self.servers = [_Server(SGLangClient(p.url, cfg.request_timeout_s, cfg.concurrency), p)
                            for p in procs]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-engine", daemon=True)
        self._thread.start()
        self._sems = self._call(self._make_semaphores())
        self._heartbeat = asyncio.run_coroutine_threadsafe(self._heartbeat_loop(), self._loop)

    # -- plumbing ---------------------------------------------------------------------------------
    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _make_semaphores(self):
        return [asyncio.Semaphore(self.cfg.concurrency) for _ in self.servers]

    @property
    def served_version(self) -> int | None:
        """The oldest version any server that is not down holds (None before the first sync)."""
        versions = [s.version for s in self.servers if not s.down]
        return None if not versions or any(v is None for v in versions) else min(versions)

    # -- weight sync ------------------------------------------------------------------------------
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

    async def _start_all(self, servers: list[_Server], model_dir: str, version: int) -> None:
        await asyncio.gather(*(self._restart(s, model_dir, version) for s in servers))

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

    async def _drain(self, server: _Server) -> None:
        """Out of rotation; wait until its running requests finish (under the old version)."""
        server.ready = False
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while server.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

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

    async def _restart(self, server: _Server, model_dir: str, version: int) -> None:
        server.ready = False
        await server.client.close()  # connections to the old process are dead anyway
        proc = server.process
        if proc.alive() or proc.proc is not None:
            await asyncio.to_thread(proc.restart, model_dir)
        else:
            await asyncio.to_thread(proc.start, model_dir)
        await asyncio.to_thread(proc.wait_healthy, self.cfg.startup_timeout_s)
        server.version, server.ready, server.failed_heartbeats, server.down = version, True, 0, False

    # -- failures ---------------------------------------------------------------------------------
    def _mark_down(self, server: _Server) -> None:
        """Out of rotation; an owned server is restarted on the newest weights."""
        server.ready, server.down = False, True
        if server.process is not None and server.recovering is None and self.model_dir is not None:
            server.recovering = asyncio.ensure_future(self._recover(server))

    async def _recover(self, server: _Server) -> None:
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

    # -- generation -------------------------------------------------------------------------------
    async def _pick(self) -> int:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            ready = [i for i, s in enumerate(self.servers) if s.ready]
            if ready:
                return min(ready, key=lambda i: self.servers[i].in_flight)
            if time.monotonic() > deadline:
                raise SGLangError(f"no SGLang server ready after {self.cfg.startup_timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def _complete(self, prompt: list[int], sampling: dict, epoch: int) -> tuple[Completion, int]:
        """One row: send, check, re-issue on failure; returns (completion, version)."""
        failures = 0
        while True:
            if self._abort_epoch != epoch:
                raise GenerationAborted("generation aborted")
            i = await self._pick()
            server = self.servers[i]
            rid = f"cadence-{uuid.uuid4().hex[:8]}-{next(self._rids)}"
            payload = completion_request(prompt, sampling, rid)
            async with self._sems[i]:
                if self._abort_epoch != epoch:
                    raise GenerationAborted("generation aborted")
                if not server.ready:  # left the rotation while we waited for a slot
                    continue
                version = server.version
                server.in_flight += 1
                self.stats.requests += 1
                try:
                    body = await server.client.generate(payload)
                    if self._abort_epoch != epoch:  # finished or cut short: the caller gave up on it
                        raise GenerationAborted("generation aborted")
                    completion = parse_completion(body, self.max_new_tokens)
                    if completion.finish_reason == "abort":
                        raise ServerUnavailable(f"{server.client.base_url}: request {rid} aborted by the server")
                    return completion, version
                except ServerUnavailable:
                    self.stats.unavailable += 1
                    if self._abort_epoch == epoch:
                        self._mark_down(server)
                    # Not a strike against the request: it is re-issued once a server is ready.
                except (MisalignedResponse, MalformedResponse, ServerHTTPError) as e:
                    kind = {MisalignedResponse: "misaligned", MalformedResponse: "malformed"}.get(type(e), "http_errors")
                    setattr(self.stats, kind, getattr(self.stats, kind) + 1)
                    failures += 1
                    if failures > self.cfg.retries:
                        raise SGLangError(f"request failed {failures} times; last: {type(e).__name__}: {e}") from e
                finally:
                    server.in_flight -= 1
            self.stats.reissued += 1
            await asyncio.sleep(self.cfg.backoff_s * 2 ** max(failures - 1, 0))

    async def _generate(self, prompts, sampling, epoch):
        return await asyncio.gather(*(self._complete(list(map(int, p)), sampling, epoch) for p in prompts))

    def generate(self, params, prompts: Sequence[Sequence[int]], rng=None, *, greedy: bool = False,
                 temperature: float | None = None, top_p: float | None = None) -> SGLangResult:
        """Same contract as JaxEngine.generate; params and rng are not used (the servers hold the
        weights: call sync_weights first; sampling seeds are the servers' own).

        Raises:
          GenerationAborted: abort() was called meanwhile.
          SGLangError: a request failed more than cfg.retries times, or no server became ready.
        """
        start = time.perf_counter()
        temperature = self.temperature if temperature is None else float(temperature)
        top_p = self.top_p if top_p is None else float(top_p)
        if self.served_version is None:
            raise SGLangError("no weights served yet: call sync_weights(params, version) first")
        sampling = {"max_new_tokens": self.max_new_tokens, "temperature": 0.0 if greedy else temperature,
                    "top_p": 1.0 if greedy else top_p, "stop_token_ids": [self.eos_id],
                    "skip_special_tokens": False, "no_stop_trim": True}
        n, m = len(prompts), self.max_new_tokens
        tokens = np.full((n, m), self.pad_id, np.int32)
        logprobs = np.zeros((n, m), np.float32)
        lengths = np.zeros((n,), np.int32)
        versions = np.zeros((n,), np.int64)
        if n:
            if min(len(p) for p in prompts) < 1:
                raise ValueError("prompts: every prompt needs at least one token (e.g. BOS)")
            rows = self._call(self._generate(prompts, sampling, self._abort_epoch))
            for r, (c, v) in enumerate(rows):
                k = len(c.tokens)
                tokens[r, :k], logprobs[r, :k], lengths[r], versions[r] = c.tokens, c.logprobs, k, v
        num = int(lengths.sum())
        self.stats.completions += n
        self.stats.tokens += num
        kept = np.zeros((n, m), np.float32) if (greedy or top_p >= 1.0) else None
        return SGLangResult(tokens, logprobs, lengths, time.perf_counter() - start, num, kept, versions)

    def abort(self) -> None:
        """Aborts every running generate() call (they raise GenerationAborted); the servers keep serving."""
        self._abort_epoch += 1

        async def abort_all():
            for s in self.servers:
                if s.ready:
                    try:
                        await s.client.abort(None)
                    except (ServerUnavailable, ServerHTTPError):
                        pass

        self._call(abort_all())

    def close(self) -> None:
        """Stops owned servers and the event loop."""
        self._heartbeat.cancel()

        async def shutdown():
            for s in self.servers:
                await s.client.close()

        try:
            self._call(shutdown(), timeout=10)
        finally:
            for s in self.servers:
                if s.process is not None:
                    s.process.stop()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
