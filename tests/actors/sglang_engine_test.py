"""The SGLang engine against a REAL sglang-jax server that Cadence launches, owns and restarts.

Needs $CADENCE_SGLANG_PYTHON (the python of a Python 3.12 venv with sglang-jax[cpu]==0.1.0rc0);
.ci/run sets it. The served model is a tiny Llama Cadence itself exported (hidden 256, 2 heads:
sglang-jax needs head_dim 128).
"""
import asyncio
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.actors.actor_loop import Actor
from cadence.actors.config import SGLangConfig
from cadence.actors.prompt_stream import PromptStream
from cadence.actors.sglang.alignment import parse_completion
from cadence.actors.sglang.checkpoint import export_for_server
from cadence.actors.sglang.client import completion_request
from cadence.actors.sglang.engine import GenerationAborted, SGLangEngine, SGLangError
from cadence.actors.sglang.testing import SKIP_REASON, sglang_python, tiny_server_model
from cadence.actors.tasks.registry import make_task
from cadence.actors.tasks.config import TaskConfig
from cadence.learner.algorithms.logprobs import token_logprobs_and_entropy
from cadence.learner.models.hf_export import hf_tensors
from cadence.learner.models.llama import forward, init_params
from cadence.protocols.ledger import SampleLedger

pytestmark = [pytest.mark.slow, pytest.mark.sglang,
              pytest.mark.skipif(not sglang_python(), reason=SKIP_REASON)]

MAX_NEW = 8
EOS, PAD = 2, 0
# Both sides run fp32 on CPU; measured max |difference| 7e-7 (different matmul/softmax kernels and
# summation orders). 1e-4 leaves room for other CPUs' instruction sets, still far below any real bug
# (a wrong token, position or temperature moves logprobs by > 1e-2).
LOGPROB_ATOL = 1e-4


def jax_logprobs(graphdef, params, prompt, completion, temperature=1.0):
    """Cadence's own behavior logprobs of completion after prompt (what the learner recomputes)."""
    toks = jnp.array([list(prompt) + list(completion)])
    n = toks.shape[1]
    logits = forward(graphdef, params, toks, jnp.arange(n)[None], jnp.ones((1, n), bool))
    lp, _ = token_logprobs_and_entropy(logits, toks, temperature=temperature)
    return np.asarray(lp[0, len(prompt):]), np.asarray(jax.nn.log_softmax(logits[0, len(prompt) - 1:-1] / temperature))


@pytest.fixture(scope="module")
def model():
    cfg = tiny_server_model()
    graphdef, p0 = init_params(cfg, 0)
    _, p1 = init_params(cfg, 1)
    return cfg, graphdef, {0: p0, 1: p1}


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    cfg, _, params = model
    sg = SGLangConfig(launch_python=sglang_python(), heartbeat_s=1.0, request_timeout_s=60.0)
    eng = SGLangEngine(sg, max_new_tokens=MAX_NEW, eos_id=EOS, pad_id=PAD,
                       export_fn=lambda p, d: export_for_server(cfg, p, d),
                       work_dir=str(tmp_path_factory.mktemp("sglang")))
    assert eng.sync_weights(params[0], 0)
    yield eng
    eng.close()


def prompts_for(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(4, 14, size=int(rng.integers(3, 9))).tolist() for _ in range(n)]


def assert_matches_model(model, result, prompts, temperature=1.0, versions=None):
    cfg, graphdef, params = model
    for r, prompt in enumerate(prompts):
        n = int(result.lengths[r])
        assert 1 <= n <= MAX_NEW
        assert (result.tokens[r, n:] == PAD).all() and (result.logprobs[r, n:] == 0).all()
        assert n == MAX_NEW or result.tokens[r, n - 1] == EOS  # stops exactly at EOS
        v = int(result.policy_versions[r]) if versions is None else versions
        ref, _ = jax_logprobs(graphdef, params[v], prompt, result.tokens[r, :n], temperature)
        np.testing.assert_allclose(result.logprobs[r, :n], ref, atol=LOGPROB_ATOL, rtol=0)


def test_generation_logprobs_match_cadence_model(engine, model):
    # Groups of identical prompts sent at once, as the actor sends them: sglang-jax's overlap
    # scheduler got these logprobs wrong (server.CPU_ARGS disables it).
    prompts = [p for p in prompts_for(6) for _ in range(4)]
    for temperature in (1.0, 0.7):  # the server reports log_softmax(logits / T), as Cadence does
        result = engine.generate(None, prompts, None, temperature=temperature)
        assert result.tokens.shape == (24, MAX_NEW) and result.num_tokens == int(result.lengths.sum())
        assert (result.policy_versions == 0).all()
        assert_matches_model(model, result, prompts, temperature)
    distinct = prompts[::4][:4]
    greedy = engine.generate(None, distinct, None, greedy=True)
    _, graphdef, params = model
    for r, prompt in enumerate(distinct):
        n = int(greedy.lengths[r])
        _, full = jax_logprobs(graphdef, params[0], prompt, greedy.tokens[r, :n])
        chosen = full[np.arange(n), greedy.tokens[r, :n]]
        assert (chosen >= full.max(axis=1) - LOGPROB_ATOL).all()  # the argmax (up to fp ties)
    assert engine.stats.misaligned == 0


def test_abort_stops_running_generation_and_server_keeps_serving(engine, model):
    prompts = prompts_for(96, seed=1)
    out = {}

    def run():
        try:
            out["result"] = engine.generate(None, prompts, None)
        except GenerationAborted as e:
            out["error"] = e

    sent = engine.stats.requests  # a running count: earlier tests' requests are in it
    t = threading.Thread(target=run)
    t.start()
    while engine.stats.requests < sent + 8:  # this call is running
        time.sleep(0.01)
    engine.abort()
    t.join(timeout=120)
    assert not t.is_alive()
    assert "error" in out, "generate() returned normally after abort()"
    after = engine.generate(None, prompts[:4], None)  # a new call is not aborted
    assert_matches_model(model, after, prompts[:4])

    # One request by id, straight through the client: the server ends it with finish_reason abort.
    client = engine.servers[0].client

    async def abort_one():
        req = asyncio.ensure_future(client.generate(completion_request(
            [1, 5, 6], {"max_new_tokens": 120, "ignore_eos": True}, rid="abort-me")))
        await asyncio.sleep(0.5)
        await client.abort("abort-me")
        return await asyncio.wait_for(req, 60)

    body = engine.pool.call(abort_one())
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    assert body["meta_info"]["completion_tokens"] < 120


def test_pause_and_continue_generation(engine, model):
    # 120 tokens: longer than sglang-jax's 50-token partial-output interval, so the raw response
    # repeats logprobs (alignment.py) and this also checks that parse_completion undoes it exactly.
    client = engine.servers[0].client
    prompt = [1, 7, 8, 9]
    payload = completion_request(prompt, {"max_new_tokens": 120, "ignore_eos": True})

    async def timed():
        t0 = time.perf_counter()
        await client.generate(payload)
        return time.perf_counter() - t0

    async def paused(unpaused_s):
        req = asyncio.ensure_future(client.generate(payload))
        await asyncio.sleep(0.1)
        await client.pause_generation("in_place")
        await asyncio.sleep(2 * unpaused_s + 1)  # twice what it needs unpaused: done unless paused
        was_done = req.done()
        await client.continue_generation()
        return was_done, await asyncio.wait_for(req, 120)

    was_done, body = engine.pool.call(paused(engine.pool.call(timed())))
    assert not was_done
    meta = body["meta_info"]
    assert meta["completion_tokens"] == 120 and meta["finish_reason"]["type"] == "length"
    completion = parse_completion(body, 120)  # aligned: ids beside logprobs agree with output_ids
    assert len(completion.tokens) == 120
    _, graphdef, params = model
    ref, _ = jax_logprobs(graphdef, params[engine.served_version], prompt, completion.tokens)
    np.testing.assert_allclose(completion.logprobs, ref, atol=LOGPROB_ATOL, rtol=0)


def test_distributed_sync_with_sglang_jax_fails_naming_the_missing_endpoint(engine, model, tmp_path):
    """sglang-jax has no weight-update endpoints: sync="distributed" must say so, and leave the server serving."""
    cfg, _, params = model
    sg = SGLangConfig(urls=(engine.servers[0].client.base_url,), sync="distributed", dist_backend="gloo",
                      dist_timeout_s=5.0, request_timeout_s=60.0)
    attached = SGLangEngine(sg, max_new_tokens=MAX_NEW, eos_id=EOS, pad_id=PAD, work_dir=str(tmp_path),
                            export_fn=lambda p, d: None, tensors_fn=lambda p: hf_tensors(cfg, p))
    try:
        with pytest.raises(SGLangError, match="HTTP 404.*sglang-jax has none"):
            attached.sync_weights(params[0], 0)
    finally:
        attached.close()
    prompts = prompts_for(2, seed=5)
    assert_matches_model(model, engine.generate(None, prompts, None, greedy=True), prompts)


def test_weight_change_in_restart_mode_labels_each_row_with_its_version(engine, model):
    prompts = prompts_for(48, seed=2)
    out = {}
    sent = engine.stats.requests  # a running count: earlier tests' requests are in it
    t = threading.Thread(target=lambda: out.update(result=engine.generate(None, prompts, None)))
    t.start()
    while engine.stats.requests < sent + 4:  # this call is running before the sync starts
        time.sleep(0.01)
    restarts_before = engine.servers[0].process.starts
    assert engine.sync_weights(model[2][1], 1)  # drains (old rows finish on v0), restarts on v1
    t.join(timeout=600)
    result = out["result"]
    assert engine.servers[0].process.starts == restarts_before + 1 and engine.served_version == 1
    assert set(result.policy_versions.tolist()) <= {0, 1} and 0 in result.policy_versions
    assert_matches_model(model, result, prompts)  # each row against the weights it says it came from
    fresh = engine.generate(None, prompts[:6], None)
    assert (fresh.policy_versions == 1).all()
    assert_matches_model(model, fresh, prompts[:6])
    assert not engine.sync_weights(model[2][1], 1)  # already served: nothing to do
    # The restarted server found the first start's compiled programs in the shared cache.
    assert os.listdir(os.path.join(engine.work_dir, "jax-cache"))


def test_server_killed_mid_run_is_restarted_and_nothing_is_lost(engine, model):
    task = make_task(TaskConfig(name="sort", num_digits=4, heldout_size=8))
    stream, ledger = PromptStream(task), SampleLedger()
    served = engine.served_version

    class Weights:  # what the actor reads: the version the server already holds
        version = served

        def latest(self):
            return model[2][served], served

    actor = Actor("actor-0", engine, task, None, Weights(), group_size=4, prompts_per_call=12, seed=0)
    prompts = stream.take(12)
    ledger.issue(prompts)
    starts, unavailable = engine.servers[0].process.starts, engine.stats.unavailable

    def kill_when_busy():
        while engine.servers[0].in_flight < 8:
            time.sleep(0.01)
        engine.servers[0].process.kill()  # SIGKILL, mid-generation

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    groups = actor.step(prompts)  # blocks through the restart; in-flight rows are re-issued
    killer.join()
    for g in groups:
        ledger.queue(g)
    assert engine.servers[0].process.starts == starts + 1 and engine.stats.restarts >= 1
    assert engine.stats.unavailable > unavailable and engine.stats.reissued > 0
    assert ledger.verify(stream.position)["queued"] == 12
    assert [g.prompt_id for g in groups] == [p.prompt_id for p in prompts]
    _, graphdef, params = model
    for g in groups:
        assert g.policy_version == served and g.timings.engine == "sglang"
        for ids, lps in zip(g.completion_tokens, g.behavior_logprobs):
            ref, _ = jax_logprobs(graphdef, params[served], g.prompt_tokens, ids)
            np.testing.assert_allclose(lps, ref, atol=LOGPROB_ATOL, rtol=0)
