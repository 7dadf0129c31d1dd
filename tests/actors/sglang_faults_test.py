"""SGLang engine failure paths that need no real server.

A FAKE HTTP server (aiohttp.web) is used here ONLY for responses a real sglang-jax server will not
produce on demand: misaligned logprobs (seen from sglang-jax 0.1.0rc0 on CPU, not reproducible at
will), malformed JSON, and main SGLang's /update_weights_from_disk (sglang-jax has no such
endpoint). A closed port is real. Kills, restarts, abort and pause run against the real server in
sglang_engine_test.py.
"""
import asyncio
import json
import threading

import numpy as np
import pytest
from aiohttp import web

from cadence.actors.config import ActorsConfig, SGLangConfig
from cadence.actors.sglang.alignment import MalformedResponse, MisalignedResponse, parse_completion
from cadence.actors.sglang.client import ServerUnavailable, SGLangClient
from cadence.actors.sglang.engine import SGLangEngine, SGLangError
from cadence.actors.sglang.server import free_port


def body(ids, lps=None, n=None, reason="length"):
    lps = [-0.5] * len(ids) if lps is None else lps
    return {"output_ids": ids, "meta_info": {
        "output_token_logprobs": [[lp, i, None] for lp, i in zip(lps, ids)],
        "completion_tokens": len(ids) if n is None else n, "finish_reason": {"type": reason}}}


def test_parse_completion_accepts_aligned_and_rejects_each_misalignment():
    ok = parse_completion(body([5, 6, 7, 2], [-1.0, -2.0, -0.5, -0.1], reason="stop"), 8)
    assert ok.tokens == [5, 6, 7, 2] and ok.logprobs == [-1.0, -2.0, -0.5, -0.1] and ok.finish_reason == "stop"
    more_logprobs = body([5, 6, 7, 8])
    more_logprobs["output_ids"] = [5, 6]  # the sglang-jax CPU bug: more logprobs than tokens
    more_logprobs["meta_info"]["completion_tokens"] = 2
    cases = {
        "logprobs for": more_logprobs,
        "differ from the ids": {**body([5, 6, 7, 8]), "output_ids": [5, 6, 9, 8]},
        "more than max_new_tokens": body(list(range(4, 14))),
        "'length' after": body([5, 6, 7]),
        "finite": body([5, 6, 7, 8], [-1.0, float("nan"), -1.0, -1.0]),
        "<= 0": body([5, 6, 7, 8], [-1.0, 0.5, -1.0, -1.0]),
    }
    for needle, b in cases.items():
        with pytest.raises(MisalignedResponse, match=needle):
            parse_completion(b, 4 if needle != "more than max_new_tokens" else 8)
    for bad in ({"text": "x"}, {"meta_info": {"completion_tokens": 2}}, body([5])["meta_info"],
                {"meta_info": {"output_token_logprobs": [["a", 5]], "completion_tokens": 1}}):
        with pytest.raises(MalformedResponse):
            parse_completion(bad, 4)


def repeated(ids, lps, interval=50):
    """What sglang-jax 0.1.0rc0 sends for output-only logprobs: every partial output repeats all so far."""
    b = body(ids, lps)
    entries = b["meta_info"]["output_token_logprobs"]
    b["meta_info"]["output_token_logprobs"] = [
        list(e) for k in range(interval, len(ids), interval) for e in entries[:k]] + entries  # copies
    return b


def test_parse_completion_undoes_only_the_exact_repeated_prefixes_bug():
    rng = np.random.default_rng(0)
    for n in (51, 100, 120, 150):
        ids = rng.integers(4, 60, size=n).tolist()
        lps = (-rng.random(n) * 5).tolist()
        b = repeated(ids, lps)
        assert len(b["meta_info"]["output_token_logprobs"]) == n + sum(range(50, n, 50))
        ok = parse_completion(b, n)
        assert ok.tokens == ids and ok.logprobs == lps
    ids, lps = list(range(4, 124)), [-1.0 - i / 1000 for i in range(120)]
    assert len(parse_completion(repeated(ids, lps), 120).tokens) == 120
    broken = []
    b = repeated(ids, lps)
    b["meta_info"]["output_token_logprobs"][7][0] = -9.0  # a repeated prefix that disagrees
    broken.append(b)
    b = repeated(ids, lps)
    b["meta_info"]["output_token_logprobs"][-110][1] = 99  # the final list disagrees with the prefixes
    broken.append(b)
    b = repeated(ids, lps)
    del b["meta_info"]["output_token_logprobs"][120]  # a prefix with a gap
    broken.append(b)
    b = body(ids, lps)
    entries = b["meta_info"]["output_token_logprobs"]
    b["meta_info"]["output_token_logprobs"] = entries[:100] + entries[:50] + entries  # shrinking prefixes
    broken.append(b)
    broken.append({**b, "meta_info": {**b["meta_info"], "output_token_logprobs": entries + entries}})  # a whole copy
    broken.append({**b, "meta_info": {**b["meta_info"], "output_token_logprobs": entries[1:50] + entries}})  # not a prefix
    # Any prefix lengths are accepted (the interval is sglang-jax's, not part of the check).
    assert parse_completion({**b, "meta_info": {**b["meta_info"], "output_token_logprobs": entries[:5] + entries}},
                            120).tokens == ids
    for b in broken:
        with pytest.raises(MisalignedResponse, match="logprobs for 120 completion tokens"):
            parse_completion(b, 120)


class FakeServer:
    """Answers /generate from a script of responses (then repeats the last one)."""

    def __init__(self, script):
        self.script, self.calls, self.updates, self.payloads = list(script), 0, [], []
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/update_weights_from_disk", self.update)
        app.router.add_get("/health_generate", self.health)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    async def generate(self, request):
        self.payloads.append(await request.json())
        reply = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        text = reply if isinstance(reply, str) else json.dumps(reply)
        return web.Response(text=text, content_type="application/json")

    async def health(self, request):
        return web.Response(text="")

    async def update(self, request):
        self.updates.append(await request.json())
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def make_engine(url, tmp_path, **kw):
    cfg = SGLangConfig(urls=(url,), sync="disk", backoff_s=0.0, heartbeat_s=60.0, request_timeout_s=5.0, **kw)
    exported = []
    eng = SGLangEngine(cfg, max_new_tokens=4, eos_id=2, pad_id=0, work_dir=str(tmp_path),
                       export_fn=lambda params, d: exported.append((params, d)))
    return eng, exported


@pytest.fixture
def fake():
    servers = []

    def make(script):
        servers.append(FakeServer(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_misaligned_and_malformed_responses_are_counted_and_reissued(fake, tmp_path):
    good = body([5, 6, 2], [-0.1, -0.2, -0.3], reason="stop")
    misaligned = {**body([5, 6, 7]), "output_ids": [5, 6]}
    server = fake([misaligned, "{not json", good])
    eng, exported = make_engine(server.url, tmp_path)
    try:
        assert eng.sync_weights("params-v3", 3)  # disk mode: export, then /update_weights_from_disk
        assert server.updates[0]["weight_version"] == "3" and server.updates[0]["model_path"] == exported[0][1]
        result = eng.generate(None, [[1, 5]], None)
        assert result.tokens[0].tolist() == [5, 6, 2, 0] and result.lengths.tolist() == [3]
        assert result.logprobs[0, :3].tolist() == pytest.approx([-0.1, -0.2, -0.3])
        assert result.policy_versions.tolist() == [3]
        assert (eng.stats.misaligned, eng.stats.malformed, eng.stats.reissued, server.calls) == (1, 1, 2, 3)
        # Every try resends the same prompt asking for output logprobs only (-1: sglang-jax's other
        # path returned wrong values; see client.completion_request), each under a fresh request id.
        assert [(p["input_ids"], p["logprob_start_len"], p["return_logprob"]) for p in server.payloads] == \
            [([1, 5], -1, True)] * 3
        assert len({p["rid"] for p in server.payloads}) == 3
    finally:
        eng.close()


def test_a_server_that_never_aligns_fails_loudly_after_retries(fake, tmp_path):
    server = fake([{**body([5, 6, 7]), "output_ids": [5, 6]}])
    eng, _ = make_engine(server.url, tmp_path, retries=2)
    try:
        eng.sync_weights("p", 0)
        with pytest.raises(SGLangError, match="3 times.*MisalignedResponse"):
            eng.generate(None, [[1, 5]], None)
        assert eng.stats.misaligned == 3
    finally:
        eng.close()


def test_closed_port_is_unavailable():
    client = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)

    async def go():
        try:
            assert not await client.health()
            with pytest.raises(ServerUnavailable):
                await client.generate({"input_ids": [1]})
        finally:
            await client.close()

    asyncio.run(go())


def test_config_validation_names_the_field(monkeypatch):
    monkeypatch.delenv("CADENCE_SGLANG_PYTHON", raising=False)
    for kw, field in [({"urls": ("http://h:1",)}, "sync"),
                      ({"urls": ("h:1",), "sync": "disk"}, "urls"), ({"concurrency": 0}, "concurrency"),
                      ({"launch_env": ("X",)}, "launch_env"), ({"request_timeout_s": 0.0}, "request_timeout_s")]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            SGLangConfig(**kw).validate()
    SGLangConfig().validate()  # defaults are valid (the python is checked only for engine=sglang)
    with pytest.raises(ValueError, match="^sglang.launch_python:"):
        ActorsConfig(engine="sglang").validate()
    ActorsConfig(engine="sglang", sglang=SGLangConfig(urls=("http://h:1",), sync="disk")).validate()
    monkeypatch.setenv("CADENCE_SGLANG_PYTHON", "/some/python")
    ActorsConfig(engine="sglang").validate()


def test_launched_servers_share_a_compilation_cache_unless_configured_otherwise(tmp_path):
    from cadence.actors.sglang.engine import server_env
    env = dict(e.split("=", 1) for e in server_env(SGLangConfig(), str(tmp_path)))
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "jax-cache")
    own = SGLangConfig(launch_env=("JAX_PLATFORMS=cpu", "JAX_COMPILATION_CACHE_DIR=/mine"))
    assert [e for e in server_env(own, str(tmp_path)) if "CACHE" in e] == ["JAX_COMPILATION_CACHE_DIR=/mine"]
    assert server_env(SGLangConfig(compile_cache=False), str(tmp_path)) == ("JAX_PLATFORMS=cpu",)


def test_disk_sync_goes_on_with_the_servers_that_answer(fake, tmp_path):
    """One attached server on a closed port (a real refusal, no fake needed) must not stop the others
    from syncing and serving; with every server dead the sync fails loudly."""
    good = fake([body([5, 2], [-0.1, -0.2], reason="stop")])
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = SGLangConfig(urls=(good.url, dead), sync="disk", backoff_s=0.0, heartbeat_s=60.0, request_timeout_s=5.0)
    eng = SGLangEngine(cfg, max_new_tokens=4, eos_id=2, pad_id=0, work_dir=str(tmp_path),
                       export_fn=lambda params, d: None)
    try:
        assert eng.sync_weights("p", 1)
        assert [(s.ready, s.version) for s in eng.servers] == [(True, 1), (False, None)]
        assert eng.served_version == 1  # the dead one does not hold the version back
        result = eng.generate(None, [[1, 5], [1, 6]], None)
        assert result.policy_versions.tolist() == [1, 1] and good.calls == 2
        assert not eng.needs_sync(1) and eng.needs_sync(2)
    finally:
        eng.close()

    cfg = SGLangConfig(urls=(dead,), sync="disk", backoff_s=0.0, heartbeat_s=60.0, request_timeout_s=5.0)
    eng = SGLangEngine(cfg, max_new_tokens=4, eos_id=2, pad_id=0, work_dir=str(tmp_path),
                       export_fn=lambda params, d: None)
    try:
        with pytest.raises(SGLangError, match="no SGLang server answered"):
            eng.sync_weights("p", 1)
    finally:
        eng.close()
