"""Every weight-sync method against the WeightSync interface (actors/sglang/weight_sync/): one test
body, run over restart (stand-in servers the engine launches and restarts), disk and distributed
(attached stand-ins: dist_receiver.py, a real process serving a transformers Llama over SGLang's
endpoints; distributed over gloo) and restart on a real sglang-jax server (marked sglang). Plus the
registry: the one place a config string becomes a method."""
import typing

import pytest

from cadence.actors.config import SGLangConfig
from cadence.actors.sglang.checkpoint import export_for_server
from cadence.actors.sglang.engine import SGLangEngine
from cadence.actors.sglang.testing import SKIP_REASON, sglang_python, tiny_server_model
from cadence.actors.sglang.weight_sync import METHODS, WeightSync, weight_sync_method
from cadence.learner.models.hf_export import hf_tensors
from cadence.learner.models.llama import init_params
from tests.actors.stand_in import assert_rows_match_model, launched_stand_in, start_stand_in

MAX_NEW, EOS, PAD = 4, 2, 0
PROMPTS = [[1, 5, 9, 3], [1, 7], [1, 4, 4, 4, 8]]
FAST = dict(heartbeat_s=60.0, request_timeout_s=60.0, backoff_s=0.05, startup_timeout_s=120.0)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_server_model()
    graphdef, p0 = init_params(cfg, 10)
    _, p1 = init_params(cfg, 11)
    return cfg, graphdef, {0: p0, 1: p1}


@pytest.fixture(params=["restart", "disk", "distributed",
                        pytest.param("restart-sglang", marks=[pytest.mark.slow, pytest.mark.sglang,
                                                              pytest.mark.skipif(not sglang_python(),
                                                                                 reason=SKIP_REASON)])])
def engine(request, model, tmp_path, monkeypatch):
    cfg, _, params = model
    export = lambda p, d: export_for_server(cfg, p, d)  # noqa: E731
    proc = None
    if request.param == "restart":
        sg = SGLangConfig(sync="restart", **launched_stand_in(), **FAST)
    elif request.param == "restart-sglang":
        sg = SGLangConfig(sync="restart", launch_python=sglang_python(), **FAST)
    else:  # attached, serving other weights until the first sync
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets, here and in the stand-in
        _, other = init_params(cfg, 99)
        url, proc = start_stand_in(export(other, str(tmp_path / "start")))
        sg = SGLangConfig(urls=(url,), sync=request.param, dist_backend="gloo", dist_timeout_s=30.0, **FAST)
    eng = SGLangEngine(sg, max_new_tokens=MAX_NEW, eos_id=EOS, pad_id=PAD, export_fn=export,
                       work_dir=str(tmp_path / "engine"), tensors_fn=lambda p: hf_tensors(cfg, p))
    try:
        yield eng
    finally:
        eng.close()
        if proc is not None:
            proc.kill()
            proc.wait()


def _serves(eng, graphdef, params, version):
    """Every row comes from `version`'s weights and says so."""
    result = eng.generate(None, PROMPTS, None, greedy=True)
    assert result.policy_versions.tolist() == [version] * len(PROMPTS)
    assert_rows_match_model(graphdef, params, PROMPTS, result, PAD)


def test_a_method_brings_the_servers_to_each_version_it_is_asked_for(engine, model):
    _, graphdef, params = model
    method = engine.weight_sync
    assert isinstance(method, WeightSync) and type(method) is METHODS[engine.cfg.sync]
    with engine.pool.sync_lock:  # the interface itself: every server to version 0
        assert method.update(engine.pool, params[0], 0)
    assert engine.served_version == 0 and all(s.ready and s.version == 0 for s in engine.servers)
    _serves(engine, graphdef, params[0], 0)

    assert not engine.sync_weights(params[0], 0)  # held already: the engine asks no method
    assert not engine.sync_weights(params[1], 1, min_version=0)  # version 0 is still within the bound
    assert engine.sync_weights(params[1], 1)
    assert engine.served_version == 1
    _serves(engine, graphdef, params[1], 1)

    engine.forget_weights()  # a resumed learner may be older: back to version 0's weights
    assert engine.sync_weights(params[0], 0)
    assert engine.served_version == 0
    _serves(engine, graphdef, params[0], 0)
    assert engine.stats.syncs == 2  # the engine's two; the first update was called directly


# -- the registry --------------------------------------------------------------------------------

def test_the_registry_holds_every_configurable_method_and_only_those():
    choices = typing.get_args(typing.get_type_hints(SGLangConfig)["sync"])
    assert set(METHODS) == set(choices)
    for name, cls in METHODS.items():
        assert weight_sync_method(name) is cls and cls.method == name and issubclass(cls, WeightSync)


def test_an_unknown_method_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"^sync: must be one of 'restart', 'disk', 'distributed', got 'nixl'"):
        SGLangConfig(sync="nixl").validate()  # built in code, past the config loader's choices
    with pytest.raises(ValueError, match="^sync:"):
        weight_sync_method("nixl")


@pytest.mark.parametrize("name, cfg, key", [
    ("restart", SGLangConfig(sync="restart", urls=("http://h:1",)), "sync"),
    ("distributed", SGLangConfig(sync="distributed", urls=("http://h:1",), dist_address="10.0.0.2"), "dist_address"),
])
def test_each_method_checks_its_own_settings(name, cfg, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        METHODS[name].check_config(cfg)
    with pytest.raises(ValueError, match=f"^{key}:"):
        cfg.validate()
    METHODS["disk"].check_config(cfg)  # the same settings suit disk


def test_an_actor_process_gets_the_method_that_fits_its_servers():
    logged = []
    attached = SGLangConfig(urls=("http://gen:1",))
    assert METHODS["restart"].for_actor_process(attached, logged.append).sync == "disk"
    assert logged and "attached servers cannot be restarted" in logged[0]
    assert METHODS["restart"].for_actor_process(SGLangConfig(), logged.append) == SGLangConfig()
    far = SGLangConfig(sync="distributed", dist_address="10.0.0.5", dist_trusted_network=True)
    assert METHODS["distributed"].for_actor_process(far, logged.append).dist_address == "127.0.0.1"
    assert METHODS["distributed"].for_actor_process(
        SGLangConfig(sync="distributed", urls=("http://gen:1",), dist_address="10.0.0.5"), logged.append
    ).dist_address == "10.0.0.5"  # attached servers elsewhere reach rank 0 at the configured address
