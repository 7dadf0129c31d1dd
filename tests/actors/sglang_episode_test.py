"""A multi-turn episode against a REAL sglang-jax server: the SGLang engine runs the same episode
code as the built-in engine (actors/episodes.py), re-sending the whole context each turn.

Checked: tool output sits between the model's turns and is masked out; the server's behavior
logprobs of every model token, in every turn, equal Cadence's own model's logprobs of that token
given the whole context (prompt, earlier turns, observations) in one forward pass, which is what
the learner computes. Needs $CADENCE_SGLANG_PYTHON (see sglang_engine_test.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.actors.config import SGLangConfig
from cadence.actors.episodes import generate_rollouts
from cadence.actors.sglang.checkpoint import export_for_server
from cadence.actors.sglang.engine import SGLangEngine
from cadence.actors.sglang.testing import SKIP_REASON, sglang_python, tiny_server_model
from cadence.actors.tasks.base import Prompt, Step
from cadence.learner.algorithms.logprobs import token_logprobs_and_entropy
from cadence.learner.models.char_tokenizer import CharTokenizer
from cadence.learner.models.llama import forward, init_params

pytestmark = [pytest.mark.slow, pytest.mark.sglang,
              pytest.mark.skipif(not sglang_python(), reason=SKIP_REASON)]

MAX_NEW, EOS, PAD = 6, 2, 0
OBS = (30, 31, 32)
LOGPROB_ATOL = 1e-4  # as in sglang_engine_test.py (measured there: 7e-7)


class Env:
    def __init__(self):
        self.n = 0

    def step(self, turn):
        self.n += 1
        return Step(observation=OBS, reward=float(len(turn.ids)), done=self.n >= 3)


class ThreeTurns:
    name, max_prompt_len, max_completion_len, max_turns = "three", 8, 40, 3

    def __init__(self):
        self.tokenizer = CharTokenizer()

    def environment(self, prompt):
        return Env()


def test_episode_runs_on_the_server_with_aligned_logprobs(tmp_path):
    cfg = tiny_server_model()
    graphdef, params = init_params(cfg, 0)
    sg = SGLangConfig(launch_python=sglang_python(), request_timeout_s=60.0)
    engine = SGLangEngine(sg, max_new_tokens=MAX_NEW, eos_id=EOS, pad_id=PAD,
                          export_fn=lambda p, d: export_for_server(cfg, p, d), work_dir=str(tmp_path))
    try:
        assert engine.sync_weights(params, 0)
        rows = [Prompt(f"p/train/{i}", i, (1, 4 + i, 5 + i, 6)) for i in range(4)]
        out = generate_rollouts(engine, None, ThreeTurns(), rows, jax.random.key(0))
    finally:
        engine.close()
    assert out.turns == [3, 3, 3, 3] and (out.versions == 0).all()
    for prompt, tokens, mask, lp in zip(rows, out.tokens, out.policy_mask, out.logprobs):
        starts = [i for i in range(1, len(mask)) if not mask[i] and mask[i - 1]]
        assert len(starts) == 2 and all(tuple(tokens[i:i + 3]) == OBS for i in starts)
        assert all(lp[i] == 0.0 for i in range(len(lp)) if not mask[i])
        seq = jnp.asarray([list(prompt.tokens) + tokens])
        n = seq.shape[1]
        logits = forward(graphdef, params, seq, jnp.arange(n)[None], jnp.ones((1, n), bool))
        ref = np.asarray(token_logprobs_and_entropy(logits, seq)[0][0, len(prompt.tokens):])
        m = np.asarray(mask)
        np.testing.assert_allclose(np.asarray(lp)[m], ref[m], atol=LOGPROB_ATOL, rtol=0)


def test_a_one_token_stop_ends_the_row_on_the_server(tmp_path):
    """A stop sequence of one id goes to the server as a stop token id: the server itself ends the
    row there (the stop id kept), as the JAX engine does in its loop."""
    cfg = tiny_server_model()
    graphdef, params = init_params(cfg, 0)
    sg = SGLangConfig(launch_python=sglang_python(), request_timeout_s=60.0)
    engine = SGLangEngine(sg, max_new_tokens=MAX_NEW, eos_id=99, pad_id=PAD,  # 99: no EOS in the way
                          export_fn=lambda p, d: export_for_server(cfg, p, d), work_dir=str(tmp_path))
    try:
        assert engine.sync_weights(params, 0)
        prompts = [[1, 4, 5, 6], [1, 7, 8, 9]]
        free = engine.generate(None, prompts, greedy=True)
        row = free.tokens[0].tolist()
        assert int(free.lengths[0]) == MAX_NEW
        stop_id = row[2]
        stopped = engine.generate(None, prompts, greedy=True, stop=[[stop_id], [40, 41]])
    finally:
        engine.close()
    first = row.index(stop_id) + 1
    assert int(stopped.lengths[0]) == first and stopped.tokens[0, :first].tolist() == row[:first]
    other = free.tokens[1].tolist()
    assert int(stopped.lengths[1]) == (other.index(stop_id) + 1 if stop_id in other else MAX_NEW)
