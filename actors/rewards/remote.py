"""RemoteScorer: rewards from an HTTP reward server (a judge model, a sandbox farm).

    scorer = RemoteScorer("http://judge:8000/score", concurrency=8, timeout_s=30, retries=2)

One POST per group, JSON both ways:

    request   {"task": "...", "prompt": {"id", "index", "text", "tokens", "answer", "metadata"},
               "completions": [{"ids": [...], "text": "..."}, ...]}
    response  {"rewards": [G numbers], "exact_match": [G booleans or null] (optional),
               "metrics": {"name": [G numbers]} (optional)}

The request is JSON as msgspec writes it: NumPy scalars and arrays in Prompt.metadata become
numbers and lists; a group whose metadata holds anything else JSON cannot carry scores 0 with the
reason remote_encode (no request is sent). At most ``concurrency`` requests are in flight. A
request that times out, cannot connect, gets an HTTP error status or a body that is not that shape
is sent again (``retries`` times, backing off); after that each completion of the group scores 0
with the reason (remote_timeout, remote_unavailable, remote_http, remote_malformed). The server's
answer is parsed as JSON and checked field by field, never evaluated.
"""
from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Sequence

import aiohttp
import msgspec
import numpy as np

from cadence.actors.rewards.scoring import Item, Progress, failed, wait_reporting
from cadence.actors.tasks.base import Score

ENCODE = "remote_encode"  # the group's prompt holds something JSON cannot carry


class _Malformed(ValueError):
    pass


def group_payload(task_name: str, group: Sequence[Item]) -> dict:
    prompt = group[0][0]
    return {
        "task": task_name,
        "prompt": {"id": prompt.prompt_id, "index": prompt.index, "text": prompt.text,
                   "tokens": list(prompt.tokens), "answer": list(prompt.answer),
                   "metadata": dict(prompt.metadata)},
        "completions": [{"ids": list(c.ids), "text": c.text} for _, c in group],
    }


def _enc_hook(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode a {type(obj).__name__} as JSON")


def encode_group(task_name: str, group: Sequence[Item]) -> bytes | None:
    """The group's request body, or None when its prompt holds something JSON cannot carry."""
    try:
        return msgspec.json.encode(group_payload(task_name, group), enc_hook=_enc_hook)
    except (TypeError, ValueError, OverflowError, NotImplementedError, msgspec.EncodeError):
        return None


def parse_response(body, group_size: int) -> list[Score]:
    """The server's JSON as G Scores; raises _Malformed naming what is wrong."""
    if not isinstance(body, dict):
        raise _Malformed(f"expected a JSON object, got {type(body).__name__}")
    rewards = body.get("rewards")
    if not isinstance(rewards, list) or len(rewards) != group_size:
        raise _Malformed(f"'rewards' must be a list of {group_size} numbers")
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) for r in rewards):
        raise _Malformed("'rewards' must hold finite numbers")
    exact = body.get("exact_match") or [None] * group_size
    if not isinstance(exact, list) or len(exact) != group_size or any(e not in (None, True, False) for e in exact):
        raise _Malformed(f"'exact_match' must be a list of {group_size} booleans or nulls")
    metrics = body.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise _Malformed("'metrics' must be an object of lists")
    for name, values in metrics.items():
        if (not isinstance(values, list) or len(values) != group_size
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           for v in values)):
            raise _Malformed(f"'metrics.{name}' must be a list of {group_size} finite numbers")
    return [Score(float(r), e, {k: float(v[i]) for k, v in metrics.items()}, "")
            for i, (r, e) in enumerate(zip(rewards, exact))]


class RemoteScorer:
    """See the module docstring. Thread-safe; call close() when done."""

    def __init__(self, url: str, task_name: str = "", concurrency: int = 8, timeout_s: float = 30.0,
                 retries: int = 2, backoff_s: float = 0.2):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward_url: must start with http:// or https://, got {url!r}")
        self.url, self.task_name = url, task_name
        self.concurrency, self.timeout_s, self.retries, self.backoff_s = concurrency, timeout_s, retries, backoff_s
        self.stats = {"requests": 0, "retries": 0, "failures": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cadence-reward-http", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None

    async def _setup(self) -> None:
        if self._session is None:
            self._sem = asyncio.Semaphore(self.concurrency)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def _post(self, body: bytes | None, group_size: int, done: list[int]) -> list[Score]:
        try:
            return await self._post_body(body, group_size)
        finally:
            done[0] += group_size

    async def _post_body(self, body: bytes | None, group_size: int) -> list[Score]:
        if body is None:
            self.stats["failures"] += 1
            return [failed(ENCODE)] * group_size
        reason = "remote_unavailable"
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            async with self._sem:
                self.stats["requests"] += 1
                try:
                    async with self._session.post(self.url, data=body,
                                                  headers={"Content-Type": "application/json"}) as resp:
                        text = await resp.text()
                        if resp.status >= 400:
                            reason = "remote_http"
                            continue
                    return parse_response(json.loads(text), group_size)
                except asyncio.TimeoutError:
                    reason = "remote_timeout"
                except (aiohttp.ClientError, OSError):
                    reason = "remote_unavailable"
                except (ValueError, _Malformed):  # json.JSONDecodeError is a ValueError
                    reason = "remote_malformed"
        self.stats["failures"] += 1
        return [failed(reason)] * group_size

    async def _score_all(self, bodies: list[bytes | None], sizes: list[int], done: list[int]) -> list[list[Score]]:
        await self._setup()
        return await asyncio.gather(*(self._post(b, n, done) for b, n in zip(bodies, sizes)))

    def score_groups(self, groups: Sequence[Sequence[Item]], progress: Progress | None = None) -> list[list[Score]]:
        groups = [list(g) for g in groups]
        if not groups:
            return []
        bodies = [encode_group(self.task_name, g) for g in groups]
        done = [0]  # completions whose group came back (this call's progress)
        future = asyncio.run_coroutine_threadsafe(self._score_all(bodies, [len(g) for g in groups], done), self._loop)
        return list(wait_reporting(future, lambda: done[0], sum(len(g) for g in groups), progress))

    def close(self) -> None:
        async def shutdown():
            if self._session is not None:
                await self._session.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
