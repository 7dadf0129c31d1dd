"""Every engine against the Engine interface (actors/engine_api.py): one test body, run over the
built-in JaxEngine, an SGLangEngine attached to a stand-in server (dist_receiver.py: a real process
serving a transformers Llama over SGLang's endpoints) and an SGLangEngine on a real sglang-jax
server it launches (marked sglang: needs $CADENCE_SGLANG_PYTHON). And the actor loop's reading of
the interface: an abort while stopping is a clean stop, told apart by type, not by name."""
import threading

import jax
import numpy as np
import pytest
import zmq

from cadence.actors.actor_loop import Actor
from cadence.actors.config import SGLangConfig
from cadence.actors.engine import EngineConfig, JaxEngine
from cadence.actors.engine_api import Engine, GenerationAborted, GenerationResult
from cadence.actors.prompt_stream import PromptStream
from cadence.actors.sglang.checkpoint import export_for_server
from cadence.actors.sglang.engine import SGLangEngine
from cadence.actors.sglang.testing import SKIP_REASON, sglang_python, tiny_server_model
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.registry import make_task
from cadence.learner.models.llama import init_params
from cadence.protocols.admission import AdmissionGate
from cadence.protocols.dispatch import Dispatcher, DispatchSettings
from cadence.protocols.dispatch_client import DispatcherClient
from cadence.protocols.dispatch_server import DispatchServer
from cadence.protocols.ledger import SampleLedger
from cadence.protocols.transport import InProcessTransport
from cadence.protocols.weights import InProcessWeights
from tests.actors.stand_in import assert_rows_match_model, start_stand_in
from tests.scripted_engine import ScriptedEngine

MAX_NEW, EOS, PAD = 6, 2, 0
PROMPTS = [[1, 5, 9, 3], [1, 7], [1, 4, 4, 4, 4, 4, 8], [1, 12, 6]]


@pytest.fixture(scope="module")
def model():
    cfg = tiny_server_model()  # the smallest Llama sglang-jax serves (head_dim 128)
    graphdef, params = init_params(cfg, 3)
    return cfg, graphdef, params


@pytest.fixture(params=["jax", "sglang-stand-in",
                        pytest.param("sglang", marks=[pytest.mark.slow, pytest.mark.sglang,
                                                      pytest.mark.skipif(not sglang_python(), reason=SKIP_REASON)])])
def engine(request, model, tmp_path):
    cfg, graphdef, params = model
    if request.param == "jax":
        eng = JaxEngine(cfg, graphdef, EngineConfig(max_new_tokens=MAX_NEW), eos_id=EOS, pad_id=PAD)
        yield eng
        eng.close()
        return
    export = lambda p, d: export_for_server(cfg, p, d)  # noqa: E731
    proc = None
    if request.param == "sglang-stand-in":  # attached, on other weights until the first sync
        _, other = init_params(cfg, 99)
        url, proc = start_stand_in(export(other, str(tmp_path / "start")))
        sg = SGLangConfig(urls=(url,), sync="disk", heartbeat_s=60.0, request_timeout_s=60.0)
    else:
        sg = SGLangConfig(launch_python=sglang_python(), heartbeat_s=60.0, request_timeout_s=60.0)
    eng = SGLangEngine(sg, max_new_tokens=MAX_NEW, eos_id=EOS, pad_id=PAD, export_fn=export,
                       work_dir=str(tmp_path / "engine"))
    try:
        yield eng
    finally:
        eng.close()
        if proc is not None:
            proc.kill()
            proc.wait()


def test_an_engine_keeps_the_interface(engine, model):
    _, graphdef, params = model
    assert isinstance(engine, Engine) and engine.name and isinstance(engine.holds_weights, bool)
    key = jax.random.key(0)

    # weights in: an engine holding weights takes them once; one reading params has nothing to take
    assert engine.sync_weights(params, 0) is engine.holds_weights
    assert engine.sync_weights(params, 0) is False
    assert engine.sync_weights(params, 0, min_version=0) is False

    result = engine.generate(params, PROMPTS, key, greedy=True)
    assert isinstance(result, GenerationResult)
    assert result.tokens.shape == result.logprobs.shape == (len(PROMPTS), MAX_NEW)
    assert result.tokens.dtype == np.int32 and result.lengths.shape == (len(PROMPTS),)
    assert result.num_tokens == int(result.lengths.sum()) and result.seconds >= 0
    assert_rows_match_model(graphdef, params, PROMPTS, result, PAD)  # the model's greedy completions
    if engine.holds_weights:
        assert result.policy_versions.tolist() == [0] * len(PROMPTS)
    else:
        assert result.policy_versions is None  # the caller's params' version
    if result.kept_logmass is not None:
        assert (result.kept_logmass == 0).all()  # greedy truncates nothing

    # a one-token stop sequence ends the row there, the token kept
    first = int(result.tokens[0, 0])
    stopped = engine.generate(params, PROMPTS[:1], key, greedy=True, stop=((first,),))
    assert stopped.lengths.tolist() == [1] and int(stopped.tokens[0, 0]) == first

    counters = engine.counters()
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in counters.items())

    # the learner restarted: whatever is held is forgotten, the next sync takes the version it is given
    engine.forget_weights()
    assert engine.sync_weights(params, 0) is engine.holds_weights

    engine.abort()  # nothing running: the engine stays usable
    again = engine.generate(params, PROMPTS, key, greedy=True)
    np.testing.assert_array_equal(again.tokens, result.tokens)
    np.testing.assert_array_equal(again.lengths, result.lengths)


# -- the actor loop's stop: an abort is told apart by its type -----------------------------------------

class ServersGone(GenerationAborted):
    """An engine's own kind of abort (a subclass): still a stop, not a failure."""


class GenerationAbortedLookalike(RuntimeError):
    pass


GenerationAbortedLookalike.__name__ = "GenerationAborted"  # another module's class of the same name


class AbortsWhileStopping(ScriptedEngine):
    """Sets the run's stop, then raises `error` from generate (as an engine aborted by the stop does)."""

    def __init__(self, stop: threading.Event, error: BaseException):
        super().__init__([[3, 3]])
        self.stop, self.error = stop, error

    def generate(self, params, prompts, key, **kw):
        self.stop.set()
        raise self.error


@pytest.mark.parametrize("error, clean", [(ServersGone("stopping"), True),
                                          (GenerationAbortedLookalike("a real failure"), False)])
def test_an_abort_while_stopping_is_a_clean_stop_by_type_not_by_name(error, clean):
    task = make_task(TaskConfig(name="sort", num_digits=3, heldout_size=4))
    settings = DispatchSettings(group_size=2, heartbeat_seconds=0.1, heartbeat_timeout_seconds=10.0, concurrency=2)
    core = Dispatcher(PromptStream(task), SampleLedger(), AdmissionGate(64, 8), settings,
                      deliver=InProcessTransport().put, version_fn=lambda: 0)
    ctx = zmq.Context()
    server = DispatchServer(core, ctx=ctx).start()
    client = DispatcherClient(server.inproc, "a0", 2, ctx=ctx, heartbeat_seconds=0.1,
                              learner_timeout_seconds=10.0).start()
    stop = threading.Event()
    actor = Actor("a0", AbortsWhileStopping(stop, error), task, client, InProcessWeights({}, 0), group_size=2,
                  prompts_per_call=2, seed=0)
    try:
        if clean:
            actor.run(stop)
            assert actor.error is None
        else:
            with pytest.raises(GenerationAbortedLookalike):
                actor.run(stop)
            assert actor.error is error
    finally:
        client.close("test over")
        server.stop()
        ctx.term()
