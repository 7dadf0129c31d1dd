"""task.reward_url against a real HTTP server on 127.0.0.1 (aiohttp), started and stopped here.

Routes: a judge that answers, one that stalls past the client's timeout, one that returns
malformed JSON, wrong shapes, HTTP errors, and one that fails once then answers. Every request
loop is bounded (retries), and the server stops with the test.
"""
import asyncio
import threading

import pytest
from aiohttp import web

from cadence.actors.rewards.remote import RemoteScorer
from cadence.actors.tasks.base import Completion, Prompt


class JudgeServer:
    def __init__(self):
        self.in_flight = 0
        self.max_in_flight = 0
        self.calls: dict[str, int] = {}
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        app = web.Application()
        for name in ("ok", "stall", "malformed", "short", "error", "flaky"):
            app.router.add_post(f"/{name}", getattr(self, name))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    async def ok(self, request):
        self._count("ok")
        body = await request.json()
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.05)
        self.in_flight -= 1
        texts = [c["text"] for c in body["completions"]]
        return web.json_response({"rewards": [float(len(t)) for t in texts],
                                  "exact_match": [t == body["prompt"]["metadata"]["answer"] for t in texts],
                                  "metrics": {"chars": [len(t) for t in texts]}})

    async def stall(self, request):
        self._count("stall")
        await asyncio.sleep(3)  # past the client's 1 s timeout (bounded: the server stops soon after)
        return web.json_response({"rewards": []})

    async def malformed(self, request):
        self._count("malformed")
        return web.Response(text='{"rewards": [1.0, ', content_type="application/json")

    async def short(self, request):
        self._count("short")
        return web.json_response({"rewards": [1.0]})

    async def error(self, request):
        self._count("error")
        return web.Response(status=500, text="judge crashed")

    async def flaky(self, request):
        self._count("flaky")
        if self.calls["flaky"] == 1:
            return web.Response(status=503, text="warming up")
        body = await request.json()
        return web.json_response({"rewards": [0.5] * len(body["completions"])})

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.close()


def group(index, *texts):
    p = Prompt(f"t/train/{index}", index, (1, 5), text="2+2?", metadata={"answer": "4"})
    return [(p, Completion((4,), t)) for t in texts]


def scorer(url, **kw):
    kw = {"concurrency": 2, "timeout_s": 1.0, "retries": 1, "backoff_s": 0.01, **kw}
    return RemoteScorer(url, "t", **kw)


def test_scores_come_from_the_server_with_bounded_concurrency(server):
    s = scorer(server.url + "/ok")
    try:
        scores = s.score_groups([group(i, "4", "four", "") for i in range(6)])
    finally:
        s.close()
    assert [(x.reward, x.exact_match, x.metrics, x.error) for x in scores[0]] == [
        (1.0, True, {"chars": 1.0}, ""), (4.0, False, {"chars": 4.0}, ""), (0.0, False, {"chars": 0.0}, "")]
    assert server.calls["ok"] == 6 and server.max_in_flight == 2
    body = server.bodies[0]
    assert body["task"] == "t" and body["prompt"]["text"] == "2+2?" and body["prompt"]["tokens"] == [1, 5]
    assert body["completions"][1] == {"ids": [4], "text": "four"}


@pytest.mark.parametrize("route, reason", [("stall", "remote_timeout"), ("malformed", "remote_malformed"),
                                           ("short", "remote_malformed"), ("error", "remote_http")])
def test_a_failing_server_scores_zero_with_the_reason_after_retries(server, route, reason):
    s = scorer(server.url + f"/{route}")
    try:
        scores = s.score_groups([group(0, "a", "b")])
    finally:
        s.close()
    assert [(x.reward, x.error) for x in scores[0]] == [(0.0, reason), (0.0, reason)]
    assert server.calls[route] == 2  # the first try and one retry, no more
    assert s.stats["failures"] == 1


def test_a_retry_recovers_from_a_transient_error(server):
    s = scorer(server.url + "/flaky")
    try:
        scores = s.score_groups([group(0, "a")])
    finally:
        s.close()
    assert [(x.reward, x.error) for x in scores[0]] == [(0.5, "")]
    assert server.calls["flaky"] == 2


def test_no_server_listening_is_unavailable(server):
    s = scorer(f"http://127.0.0.1:{server.port}/ok".replace(str(server.port), "1"))  # port 1: refused
    try:
        scores = s.score_groups([group(0, "a")])
    finally:
        s.close()
    assert scores[0][0].error == "remote_unavailable"
