"""SGLangEngine: SGLang servers behind the Engine interface (actors/engine_api.py), weights held by them.

    engine = SGLangEngine(cfg.actors.sglang, max_new_tokens=8, eos_id=2, pad_id=0,
                          export_fn=lambda params, d: export_for_server(model_cfg, params, d),
                          work_dir="/run/sglang")
    engine.sync_weights(params, version)            # start / bring servers to this version
    result = engine.generate(params, prompts, key)  # GenerationResult, policy_versions per row

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

Behavior logprobs are the server's ``output_token_logprobs``; they match Cadence's JAX model within
1e-4 (measured 7e-7, both fp32 on CPU, sglang-jax:
tests/actors/sglang_engine_test.py::test_generation_logprobs_match_cadence_model).

The engine is composed of three parts: this module (generation, abort, when to sync), a ServerPool
(pool.py: the servers, the event loop driving them, routing, health and recovery) and a WeightSync
(weight_sync/: how servers get new weights, one class per actors.sglang.sync method, chosen by
weight_sync_method); results.py holds what they count and raise.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
import uuid
from typing import Any, Callable, Sequence

import numpy as np

from cadence.actors.config import SGLangConfig
from cadence.actors.engine_api import Engine, GenerationResult
from cadence.actors.sglang.alignment import Completion, MalformedResponse, MisalignedResponse, parse_completion
from cadence.actors.sglang.client import ServerHTTPError, ServerUnavailable, completion_request
from cadence.actors.sglang.pool import Exports, Server, ServerPool, server_env
from cadence.actors.sglang.results import EngineStats, GenerationAborted, SGLangError, SGLangResult
from cadence.actors.sglang.weight_sync import weight_sync_method

__all__ = ["EngineStats", "GenerationAborted", "SGLangEngine", "SGLangError", "SGLangResult", "server_env"]


class SGLangEngine(Engine):
    """See the module docstring. Call close() when done (stops owned servers)."""

    name = "sglang"
    holds_weights = True

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
        self.cfg = cfg
        self.max_new_tokens, self.eos_id, self.pad_id = int(max_new_tokens), int(eos_id), int(pad_id)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.work_dir = os.path.abspath(work_dir)
        self.exports = Exports(export_fn, self.work_dir)  # the newest checkpoint, what restarts load
        # How servers get new weights: one class per cfg.sync (raises ValueError for what it lacks).
        self.weight_sync = weight_sync_method(cfg.sync)(cfg, self.exports, tensors_fn=tensors_fn,
                                                        gather_fn=gather_fn)
        os.makedirs(self.work_dir, exist_ok=True)
        self.stats = EngineStats()
        self._abort_epoch = 0
        self._rids = itertools.count()
        self.pool = ServerPool(cfg, self.work_dir, self.stats, self.exports, self.weight_sync)

    @property
    def servers(self) -> list[Server]:
        return self.pool.servers

    @property
    def served_version(self) -> int | None:
        """The oldest version any server that is not down holds (None before the first sync)."""
        return self.pool.served_version

    # -- weights in ---------------------------------------------------------------------------------
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
        actors' requests meanwhile finish under the old version or wait for the new one. How: the
        engine's WeightSync (cfg.sync).
        """
        with self.pool.sync_lock:
            if not self.needs_sync(version, min_version):
                return False
            t0 = time.perf_counter()
            if not self.weight_sync.update(self.pool, params, version):
                return False  # only a server still down was waiting
            self.stats.syncs += 1
            self.stats.sync_seconds += time.perf_counter() - t0
            return True

    def forget_weights(self) -> None:
        """The learner restarted, and its resumed run may be older than what the servers hold: the
        next sync_weights() brings every server to the version it is given, whatever it held."""
        with self.pool.sync_lock:
            for s in self.servers:
                s.version = None

    def counters(self) -> dict[str, float]:
        """EngineStats as floats (cumulative)."""
        return {k: float(v) for k, v in dataclasses.asdict(self.stats).items()}

    # -- generation -------------------------------------------------------------------------------
    async def _complete(self, prompt: list[int], sampling: dict, epoch: int) -> tuple[Completion, int]:
        """One row: send, check, re-issue on failure; returns (completion, version)."""
        failures = 0
        while True:
            if self._abort_epoch != epoch:
                raise GenerationAborted("generation aborted")
            i = await self.pool.pick()
            server = self.servers[i]
            rid = f"cadence-{uuid.uuid4().hex[:8]}-{next(self._rids)}"
            payload = completion_request(prompt, sampling, rid)
            async with self.pool.slots[i]:
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
                        self.pool.mark_down(server)
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
                 temperature: float | None = None, top_p: float | None = None,
                 stop: Sequence[Sequence[int]] = ()) -> GenerationResult:
        """Same contract as JaxEngine.generate; params and rng are not used (the servers hold the
        weights: call sync_weights first; sampling seeds are the servers' own).

        stop: one-token sequences go to the server as stop_token_ids (it ends the row there, the
        id kept). Longer ones are not sent: SGLang matches stop strings on decoded text, and the
        servers run without a tokenizer (--skip-tokenizer-init; sglang-jax then fails on "stop"),
        so the caller cuts such a row after the sequence (actors/episodes.py does).

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
                    "top_p": 1.0 if greedy else top_p,
                    "stop_token_ids": [self.eos_id, *sorted({int(q[0]) for q in stop if len(q) == 1} - {self.eos_id})],
                    "skip_special_tokens": False, "no_stop_trim": True}
        n, m = len(prompts), self.max_new_tokens
        tokens = np.full((n, m), self.pad_id, np.int32)
        logprobs = np.zeros((n, m), np.float32)
        lengths = np.zeros((n,), np.int32)
        versions = np.zeros((n,), np.int64)
        if n:
            if min(len(p) for p in prompts) < 1:
                raise ValueError("prompts: every prompt needs at least one token (e.g. BOS)")
            rows = self.pool.call(self._generate(prompts, sampling, self._abort_epoch))
            for r, (c, v) in enumerate(rows):
                k = len(c.tokens)
                tokens[r, :k], logprobs[r, :k], lengths[r], versions[r] = c.tokens, c.logprobs, k, v
        num = int(lengths.sum())
        self.stats.completions += n
        self.stats.tokens += num
        kept = np.zeros((n, m), np.float32) if (greedy or top_p >= 1.0) else None
        return GenerationResult(tokens, logprobs, lengths, time.perf_counter() - start, num, kept, versions)

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

        self.pool.call(abort_all())

    def close(self) -> None:
        """Stops owned servers and the event loop."""
        self.pool.close()
