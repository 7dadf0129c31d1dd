"""learner.logits_chunk: log-probs/entropy from hidden states in chunks equal the whole-logits path
(values and gradients, float32, within 1e-5), in the pure function and in the GRPO, PPO and SFT steps."""

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from grpo_step_test import PAD, T, V, make_groups  # noqa: E402  (shared stand-in groups)

from cadence.learner.algorithms.logprobs import chunked_token_logprobs, logits_token_scores  # noqa: E402
from cadence.learner.batching import build_microbatches  # noqa: E402
from cadence.learner.config import GRPOConfig, LearnerConfig, OptimizerConfig, PPOConfig, SFTConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.steps import make_train_step  # noqa: E402
from cadence.learner.steps.grpo_step import GRPOTrainStep  # noqa: E402
from cadence.learner.steps.scoring import SplitLogits, llama_logits, score_tokens  # noqa: E402
from cadence.learner.steps.sft_step import SFTStep, build_sft_batch  # noqa: E402

B, TT, D, VV = 3, 13, 8, 11  # the pure-function case: a prime length, so most chunks pad


def _case(seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(B, TT, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, VV)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, VV, size=(B, TT)), jnp.int32)
    return hidden, w, tokens


def _np_scores(hidden, w, tokens, temperature):
    """float64 NumPy reference: (logprobs, entropy, greedy), [B, T] aligned (column 0 empty)."""
    z = np.asarray(hidden, np.float64) @ np.asarray(w, np.float64) / temperature  # [B, T, V]
    z = z[:, :-1]
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    y = np.asarray(tokens)[:, 1:]
    lp = np.take_along_axis(z, y[..., None], -1)[..., 0] - lse
    p = np.exp(z - lse[..., None])
    ent = -(p * np.log(p)).sum(-1)
    greedy = z.argmax(-1) == y
    pad = lambda x: np.concatenate([np.zeros_like(x[:, :1]), x], axis=1)  # noqa: E731
    return pad(lp), pad(ent), pad(greedy)


@pytest.mark.parametrize("chunk, temperature", [
    (1, 0.7), (4, 1.0), (5, 0.7), (12, 0.7),  # T = 13: chunks of 1, padded chunks (12: 11 of padding)
    (13, 0.7), (16, 1.0), (0, 0.7),            # a chunk covering the row, and off: the whole path
])
def test_chunked_scores_equal_numpy_and_whole_logits(chunk, temperature):
    hidden, w, tokens = _case()
    head = lambda h: h @ w  # noqa: E731
    got = chunked_token_logprobs(hidden, head, tokens, temperature, chunk, entropy=True, greedy=True)
    lp, ent, greedy = _np_scores(hidden, w, tokens, temperature)
    np.testing.assert_allclose(np.asarray(got.logprobs), lp, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.entropy), ent, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.greedy), greedy)
    whole = logits_token_scores(head(hidden), tokens, temperature, entropy=True, greedy=True)
    for a, b in zip(got, whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert got.logprobs.shape == got.entropy.shape == (B, TT) and got.logprobs.dtype == jnp.float32
    only = chunked_token_logprobs(hidden, head, tokens, temperature, chunk)
    assert only.entropy is None and only.greedy is None


@pytest.mark.parametrize("chunk", [4, 13])
def test_chunked_gradients_equal_whole_logits(chunk):
    hidden, w, tokens = _case(1)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(2, B, TT)), jnp.float32)

    def loss(hidden, w, chunked):
        head = lambda h: h @ w  # noqa: E731
        s = (chunked_token_logprobs(hidden, head, tokens, 0.8, chunk, entropy=True) if chunked
             else logits_token_scores(head(hidden), tokens, 0.8, entropy=True))
        return jnp.sum(weights[0] * s.logprobs + weights[1] * s.entropy)

    got = jax.grad(loss, argnums=(0, 1))(hidden, w, True)
    ref = jax.grad(loss, argnums=(0, 1))(hidden, w, False)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert float(jnp.abs(got[0][:, -1]).max()) == 0.0  # the last position predicts nothing


def test_backward_recomputes_logits_instead_of_keeping_them():
    """Under value_and_grad, what the chunked path keeps between forward and backward is far
    smaller than the [B, T, V] logits the whole path keeps (XLA's compiled temp memory)."""
    rng = np.random.default_rng(0)
    b, t, d, v = 4, 256, 16, 4096
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)) * 0.1, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)

    def temp_bytes(chunk):
        def loss(hidden, w):
            return jnp.sum(chunked_token_logprobs(hidden, lambda h: h @ w, tokens, 1.0, chunk,
                                                  entropy=True).logprobs)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, w).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = b * t * v * 4
    whole, chunked = temp_bytes(0), temp_bytes(32)
    assert whole >= logits_bytes
    assert chunked < logits_bytes / 2


# ---- the steps, on a tiny real Llama ----

def _model(tie: bool):
    mcfg = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                       max_seq_len=T, tie_embeddings=tie)
    return llama.init_params(mcfg, 0)


def _grpo_cfg(chunk, **grpo):
    grpo = {"correction": "coupled", **grpo}
    return LearnerConfig(batch_size=16, microbatch_size=4, group_size=4, logits_chunk=chunk,
                         optimizer=OptimizerConfig(lr=1e-2), grpo=dataclasses.replace(GRPOConfig(), **grpo))


def _close(a, b, atol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-5)


def test_split_logits_call_is_forward():
    graphdef, params = _model(True)
    fn = llama_logits(graphdef)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, T)), jnp.int32)
    pos, mask = jnp.broadcast_to(jnp.arange(T), tokens.shape), tokens != PAD
    np.testing.assert_array_equal(np.asarray(fn(params, tokens, pos, mask)),
                                  np.asarray(llama.forward(graphdef, params, tokens, pos, mask)))


@pytest.mark.parametrize("tie, chunk, entropy_coef", [  # T = 8: chunks of 3 pad, of 4 divide
    (True, 3, 0.05), (False, 4, 0.05), (False, 3, 0.0)])
def test_grpo_loss_and_gradients_match_unchunked(tie, chunk, entropy_coef):
    graphdef, params = _model(tie)
    whole = GRPOTrainStep(llama_logits(graphdef), _grpo_cfg(0, entropy_coef=entropy_coef), temperature=0.8)
    chunked = GRPOTrainStep(llama_logits(graphdef), _grpo_cfg(chunk, entropy_coef=entropy_coef), temperature=0.8)
    (full,), stats = build_microbatches(make_groups(2, seed=3), T, 8, PAD, whole.cfg.grpo)
    n = jnp.float32(stats["num_tokens"])
    (l0, m0), g0 = jax.jit(jax.value_and_grad(whole.loss_fn, has_aux=True))(params, full, n)
    (l1, m1), g1 = jax.jit(jax.value_and_grad(chunked.loss_fn, has_aux=True))(params, full, n)
    np.testing.assert_allclose(float(l1), float(l0), atol=1e-5)
    assert m0.keys() == m1.keys() and ("entropy" in m0) == (entropy_coef > 0)
    _close(m1, m0)
    _close(g1, g0)
    if not tie:
        assert float(jnp.abs(g1["lm_head"]["kernel"][...]).sum()) > 0
    # Proximal (no-gradient) log-probs agree too.
    packed = whole.pack([full])[0]
    _close(chunked._proximal(params, packed), whole._proximal(params, packed))


def test_microbatched_train_step_gives_the_same_params():
    graphdef, params = _model(True)
    groups = make_groups(4, seed=4)
    out = {}
    for chunk in (0, 3):
        step = make_train_step(graphdef, _grpo_cfg(chunk, entropy_coef=0.01), temperature=0.8)
        mbs, stats = build_microbatches(groups, T, 4, PAD, step.cfg.grpo)
        assert len(mbs) == 4
        state = step.init(params)
        for _ in range(2):
            state, metrics = step.update(state, mbs, stats["num_tokens"])
        out[chunk] = state.params, metrics
    _close(out[3][0], out[0][0])
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        np.testing.assert_allclose(out[3][1][key], out[0][1][key], atol=1e-5, rtol=1e-5)


def test_ppo_step_matches_unchunked():
    graphdef, params = _model(False)
    groups = make_groups(4, seed=5)
    out = {}
    for chunk in (0, 3):
        cfg = dataclasses.replace(_grpo_cfg(chunk, entropy_coef=0.02), algorithm="ppo",
                                  ppo=dataclasses.replace(PPOConfig(), kl_coef=0.1, kl_placement="loss"))
        step = make_train_step(graphdef, cfg, temperature=0.8)
        mbs, stats = build_microbatches(groups, T, 8, PAD, cfg.grpo)
        state = step.init(params)
        for _ in range(2):
            state, metrics = step.update(state, mbs, stats["num_tokens"])
        out[chunk] = state, metrics
    _close(out[3][0].params, out[0][0].params)
    _close(out[3][0].critic_params, out[0][0].critic_params)
    for key in ("loss", "kl_ref", "entropy", "value_loss"):
        np.testing.assert_allclose(out[3][1][key], out[0][1][key], atol=1e-5, rtol=1e-5)


def test_sft_step_matches_unchunked():
    graphdef, params = _model(True)
    batch = build_sft_batch([[1, 4], [1, 5, 6], [1, 3]], [[7, 2, 9, 3], [8, 2], [4, 4, 5, 6, 2]], T, PAD,
                            batch_size=4)
    out = {}
    for chunk in (0, 3):
        step = SFTStep(llama_logits(graphdef), SFTConfig(lr=1e-2), logits_chunk=chunk)
        p, opt = params, step.init(params)
        for _ in range(2):
            p, opt, metrics = step.update(p, opt, batch)
        out[chunk] = p, metrics
    _close(out[3][0], out[0][0])
    assert out[3][1] == pytest.approx(out[0][1], abs=1e-5)


def test_plain_logits_function_is_scored_whole_unless_a_chunk_would_split_it():
    def plain(params, tokens, positions, mask):
        return jnp.zeros(tokens.shape + (V,))

    tokens = jnp.ones((1, T), jnp.int32)
    with pytest.raises(ValueError, match="logits_chunk: 4 splits rows of 8 tokens"):
        score_tokens(plain, None, tokens, tokens, tokens > 0, chunk=4)
    (full,), stats = build_microbatches(make_groups(1, seed=0), T, 4, PAD, GRPOConfig())
    with pytest.raises(ValueError, match="logits_chunk"):
        GRPOTrainStep(plain, _grpo_cfg(4)).loss_fn(None, full, 1.0)
    with pytest.raises(ValueError, match="logits_chunk"):
        SFTStep(plain, SFTConfig(), logits_chunk=4).loss_fn(None, full)
    for chunk in (0, T, 256):  # nothing to split: the whole logits, as with the default config
        got = score_tokens(plain, None, tokens, tokens, tokens > 0, chunk=chunk).logprobs
        np.testing.assert_allclose(np.asarray(got[:, 1:]), -np.log(V), rtol=1e-6)
    assert LearnerConfig().logits_chunk >= T and isinstance(llama_logits(_model(True)[0]), SplitLogits)
