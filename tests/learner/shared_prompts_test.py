"""learner.share_prompts: a GRPO group's completions in a packed row follow one copy of its prompt.
The layout, attention confined to a completion's own tokens and its prefix (no leakage between
completions), and loss and gradients equal to the unshared packed layout."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from cadence.learner import segments
from cadence.learner.config import GRPOConfig, LearnerConfig, OptimizerConfig
from cadence.learner.models import llama
from cadence.learner.models.config import ModelConfig
from cadence.learner.packing import layout_microbatches, pack_microbatches
from cadence.learner.steps.grpo_step import GRPOTrainStep, count_sequences
from cadence.protocols.testing import random_groups, rollout_group

MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=48)
T, PAD, G = 32, 0, 4


@functools.lru_cache(maxsize=1)
def _model():
    return llama.init_params(MODEL, 0)


def _groups(num_groups, seed, max_completion=12, prompt_len=(1, 9)):
    return random_groups(num_groups, seed, MODEL.vocab_size, G, max_completion, prompt_len)


def _cfg(share, **grpo):
    return LearnerConfig(batch_size=16, microbatch_size=4, group_size=G, microbatch_tokens=2 * T,
                         share_prompts=share, optimizer=OptimizerConfig(lr=1e-2),
                         grpo=dataclasses.replace(GRPOConfig(), **grpo))


def test_layout_one_prompt_copy_then_each_completion_behind_its_last_token():
    prompt, comps = [1, 5, 6], [[7, 8, 9], [10, 11], [12]]
    group = rollout_group("g", "t", prompt, comps, [[-0.5] * len(c) for c in comps], [1.0, 0.0, 0.5], 0)
    (mb,), stats = pack_microbatches([group], 16, 1, PAD, GRPOConfig(), share_prompts=True)
    n = 2 + 4 + 3 + 2  # prefix [1 5], then [6 7 8 9], [6 10 11], [6 12]
    assert mb.tokens[0, :n].tolist() == [1, 5, 6, 7, 8, 9, 6, 10, 11, 6, 12]
    assert mb.positions[0, :n].tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 2, 3]
    assert segments.sequence_ids(mb.mask[0, :n]).tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4]
    assert segments.prefix_ids(mb.mask[0, :n]).tolist() == [0, 0] + [1] * 9
    assert mb.loss_mask[0, :n].tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 1]
    assert (mb.mask[0, n:] == 0).all() and (mb.tokens[0, n:] == PAD).all()
    assert stats["shared_prompt_tokens"] == 3 * 3 - (2 + 3) and stats["num_tokens"] == 6
    assert count_sequences([mb]) == 3


def test_attention_sees_the_prefix_and_its_own_completion_only():
    graphdef, params = _model()
    groups = _groups(1, seed=1, max_completion=6, prompt_len=(4, 5))
    (mb,), _ = pack_microbatches(groups, T, 1, PAD, GRPOConfig(), share_prompts=True)
    fwd = jax.jit(functools.partial(llama.forward, graphdef))
    base = np.asarray(fwd(params, mb.tokens, mb.positions, mb.mask))
    seq, prefix = segments.sequence_ids(mb.mask[0]), segments.prefix_ids(mb.mask[0])
    second = np.flatnonzero(seq == 3)  # the second completion's cells
    others = np.flatnonzero((seq != 3) & (prefix > 0))  # the other completions' cells
    tokens = mb.tokens.copy()
    tokens[0, others] = (tokens[0, others] + 7) % MODEL.vocab_size  # change every other completion
    changed = np.asarray(fwd(params, tokens, mb.positions, mb.mask))
    np.testing.assert_array_equal(changed[0, second], base[0, second])  # no leakage
    tokens = mb.tokens.copy()
    tokens[0, 0] = (tokens[0, 0] + 7) % MODEL.vocab_size  # the shared prefix: seen by every completion
    seen = np.asarray(fwd(params, tokens, mb.positions, mb.mask))
    assert np.abs(seen[0, second] - base[0, second]).max() > 1e-4


@pytest.mark.parametrize("grpo", [{}, {"aggregation": "seq_mean_token_mean"}, {"importance_level": "sequence"}])
def test_loss_and_gradients_equal_the_unshared_layout(grpo):
    graphdef, params = _model()
    groups = _groups(6, seed=2)
    steps = {share: GRPOTrainStep(functools.partial(llama.forward, graphdef), _cfg(share, **grpo))
             for share in (False, True)}
    out = {}
    for share, step in steps.items():
        mbs, stats = layout_microbatches(groups, T, 4, 2 * T, PAD, step.cfg.grpo, share_prompts=share)
        grads, per_mb = step.accumulate_gradients(params, mbs, stats["num_tokens"])
        out[share] = (grads, float(sum(np.asarray(x)[step.metric_keys.index("loss")] for x in per_mb)),
                      len(mbs), stats, count_sequences(mbs))
    (g0, l0, n0, s0, q0), (g1, l1, n1, s1, q1) = out[False], out[True]
    assert l1 == pytest.approx(l0, rel=1e-5, abs=1e-7)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-4)
    assert q1 == q0 == 6 * G and s1["num_tokens"] == s0["num_tokens"]
    assert s1["shared_prompt_tokens"] > 0 and n1 <= n0


def test_a_group_longer_than_a_row_is_cut_into_chunks_each_with_the_prefix():
    graphdef, params = _model()
    groups = _groups(3, seed=3, max_completion=20, prompt_len=(8, 9))  # 4 x (9 + 20) do not fit 32
    steps = {share: GRPOTrainStep(functools.partial(llama.forward, graphdef), _cfg(share)) for share in (False, True)}
    mbs, stats = layout_microbatches(groups, T, 4, 2 * T, PAD, GRPOConfig(), share_prompts=True)
    prefixes = sum(int(np.sum((segments.prefix_ids(mb.mask) == 0) & (segments.sequence_ids(mb.mask) > 0)
                              & (mb.positions == 0))) for mb in mbs)
    assert prefixes > len(groups)  # some group needed more than one prefix copy
    plain, pstats = layout_microbatches(groups, T, 4, 2 * T, PAD, GRPOConfig())
    g1, _ = steps[True].accumulate_gradients(params, mbs, stats["num_tokens"])
    g0, _ = steps[False].accumulate_gradients(params, plain, pstats["num_tokens"])
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-4)


def test_units_and_flat_groups_keep_their_meaning_with_shared_prompts():
    groups = _groups(5, seed=4)
    mbs, stats = layout_microbatches(groups, T, 4, 2 * T, PAD, GRPOConfig(), units=2, share_prompts=True)
    plain, pstats = layout_microbatches(groups, T, 4, 2 * T, PAD, GRPOConfig(), units=2)
    assert stats["unit_samples"] == pstats["unit_samples"] and sum(stats["unit_microbatches"]) == len(mbs)


def test_config_needs_packing_for_shared_prompts():
    with pytest.raises(ValueError, match="share_prompts.*microbatch_tokens"):
        dataclasses.replace(_cfg(True), microbatch_tokens=0).validate()
    _cfg(True).validate()
