"""Supervised warm-up: batch layout, answer-only loss vs NumPy, memorisation of a tiny problem."""

import jax.numpy as jnp
import numpy as np
import pytest

from cadence.learner.config import SFTConfig
from cadence.learner.steps.sft_step import SFTStep, build_sft_batch

V, T, D = 16, 6, 16
PAD = 0


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.normal(size=(V, D)) * 0.5, jnp.float32),
        "pos": jnp.asarray(rng.normal(size=(T, D)) * 0.3, jnp.float32),
        "head": jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32),
    }


def logits_fn(params, tokens, positions, mask):
    del mask
    return jnp.tanh(params["embed"][tokens] + params["pos"][positions]) @ params["head"]  # [B, T, V]


def test_build_sft_batch_layout():
    batch = build_sft_batch([[1, 4], [1, 5, 6]], [[7, 2], [8, 9, 10, 2]], seq_len=T, pad_id=PAD, batch_size=3)
    np.testing.assert_array_equal(batch.tokens, [[1, 4, 7, 2, 0, 0], [1, 5, 6, 8, 9, 10], [0] * 6])
    np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1], [0] * 6])
    np.testing.assert_array_equal(batch.mask, batch.tokens != 0)
    np.testing.assert_array_equal(batch.positions, np.tile(np.arange(T), (3, 1)))
    with pytest.raises(ValueError, match="prompt of 6 tokens"):
        build_sft_batch([[1] * 6], [[2]], seq_len=T, pad_id=PAD)
    with pytest.raises(ValueError, match="exceed batch_size"):
        build_sft_batch([[1], [1]], [[2], [2]], seq_len=T, pad_id=PAD, batch_size=1)


def test_loss_is_answer_token_nll_and_ignores_padding_rows():
    params = init_params()
    step = SFTStep(logits_fn, SFTConfig(lr=1e-2))
    prompts, answers = [[1, 4], [1, 5, 6]], [[7, 2], [8, 2]]
    batch = build_sft_batch(prompts, answers, T, PAD)
    loss, _ = step.loss_fn(params, batch)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    nll = []
    for prompt, answer in zip(prompts, answers):
        seq = prompt + answer
        for t in range(len(prompt), len(seq)):
            z = np.tanh(p["embed"][seq[t - 1]] + p["pos"][t - 1]) @ p["head"]
            nll.append(np.log(np.exp(z).sum()) - z[seq[t]])
    np.testing.assert_allclose(float(loss), np.mean(nll), rtol=1e-5)
    padded, _ = step.loss_fn(params, build_sft_batch(prompts, answers, T, PAD, batch_size=5))
    np.testing.assert_allclose(float(padded), float(loss), rtol=1e-6)


def test_loss_drops_on_a_memorisation_problem():
    prompts = [[1, 3 + k] for k in range(4)]
    answers = [[8 + k, 2] for k in range(4)]
    batch = build_sft_batch(prompts, answers, T, PAD, batch_size=8)
    step = SFTStep(logits_fn, SFTConfig(steps=40, lr=3e-2))
    params = init_params(1)
    opt_state = step.init(params)
    history = []
    for _ in range(step.cfg.steps):
        params, opt_state, metrics = step.update(params, opt_state, batch)
        history.append(metrics)
    assert history[0]["tokens"] == 8
    assert history[-1]["loss"] < 0.25 * history[0]["loss"]
    assert history[-1]["token_accuracy"] == 1.0 and history[0]["token_accuracy"] < 1.0


def test_environment_tokens_in_a_transcript_are_out_of_the_loss():
    # Hand-made transcript: call [7 2], tool output [11 12] (mask False), answer [9 2] -> the loss is
    # the NLL of 7, 2, 9, 2 only, with 11 and 12 in the context.
    prompt, answer, keep = [1, 4], [7, 2, 11, 12, 9, 2], [True, True, False, False, True, True]
    batch = build_sft_batch([prompt], [answer], seq_len=10, pad_id=PAD, answer_masks=[keep])
    np.testing.assert_array_equal(batch.tokens[0], [1, 4, 7, 2, 11, 12, 9, 2, 0, 0])
    np.testing.assert_array_equal(batch.mask[0], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1, 0, 0, 1, 1, 0, 0])
    # an empty mask trains on the whole answer; a mask of the wrong length is refused
    plain = build_sft_batch([prompt, prompt], [answer, [9, 2]], 10, PAD, answer_masks=[keep, ()])
    np.testing.assert_array_equal(plain.loss_mask[1], [0, 0, 1, 1, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="answer mask of 2 for 6"):
        build_sft_batch([prompt], [answer], 10, PAD, answer_masks=[[True, False]])
    # the step's loss is the mean NLL over the kept tokens only (vs NumPy)
    params = init_params()
    step = SFTStep(logits_fn, SFTConfig(lr=1e-2))
    batch = build_sft_batch([prompt], [answer[:4]], seq_len=T, pad_id=PAD, answer_masks=[keep[:4]])
    loss, metrics = step.loss_fn(params, batch)
    logits = np.asarray(logits_fn(params, batch.tokens, batch.positions, batch.mask))[0]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -np.mean([logp[t - 1, batch.tokens[0, t]] for t in (2, 3)])  # 7 and 2; 11 and 12 are not
    assert float(metrics["tokens"]) == 2 and float(loss) == pytest.approx(want, rel=1e-5)
