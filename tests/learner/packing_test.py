"""Packed microbatches (learner.microbatch_tokens): layout, attention confined to each sequence
(no leakage), loss and gradients equal to the padded layout, no recompilation, config errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.learner.algorithms.grpo import segment_sums, sequence_mean, sequences_with_tokens
from cadence.learner.algorithms.logprobs import token_logprobs
from cadence.learner.batching import build_microbatches, pack_microbatch, unpack_microbatch
from cadence.learner.config import GRPOConfig, LearnerConfig, OptimizerConfig
from cadence.learner.models import llama
from cadence.learner.models.config import ModelConfig
from cadence.learner.packing import (first_fit_decreasing, layout_microbatches, pack_microbatches, rows_per_microbatch,
                                     split_units)
from cadence.learner.steps.grpo_step import GRPOTrainStep, count_sequences as host_count_sequences
from cadence.protocols.testing import random_groups, rollout_group

MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)
T, PAD, G = 24, 0, 4


@functools.lru_cache(maxsize=1)
def _model():
    return llama.init_params(MODEL, 0)


def _groups(num_groups, seed, max_completion=12, prompt_len=(2, 6)):
    return random_groups(num_groups, seed, MODEL.vocab_size, G, max_completion, prompt_len)


def _cfg(microbatch_tokens=0, **grpo):
    return LearnerConfig(batch_size=16, microbatch_size=4, group_size=G, microbatch_tokens=microbatch_tokens,
                         optimizer=OptimizerConfig(lr=1e-2), grpo=dataclasses.replace(GRPOConfig(), **grpo))


# ---- layout ----


def test_first_fit_decreasing_longest_first_into_the_first_row_with_room():
    row, offset, segment, used = first_fit_decreasing(np.array([3, 7, 2, 5, 4]), 10)
    # order 7, 5, 4, 3, 2: 7 -> row 0; 5 -> row 1; 4 -> row 1 (0 has 3 left); 3 -> row 0; 2 -> row 2
    assert used == 3
    assert row.tolist() == [0, 0, 2, 1, 1]
    assert offset.tolist() == [7, 0, 0, 0, 5]
    assert segment.tolist() == [2, 1, 1, 1, 2]


def test_layout_segments_positions_restart_and_per_token_advantages():
    prompt = [1, 5, 6]
    comps = [[7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20]]
    behav = [[-0.5 - i for i in range(len(c))] for c in comps]
    group = rollout_group("g", "t", prompt, comps, behav, [1.0, 0.0, 0.5], 0)
    cfg = GRPOConfig()
    (mb,), stats = pack_microbatches([group], 16, 2, PAD, cfg)
    # lengths 8, 5, 10: 10 -> row 0; 8 -> row 1 (row 0 has 6 left); 5 -> row 0
    np.testing.assert_array_equal(mb.mask, [[1] * 10 + [2] * 5 + [0], [1] * 8 + [0] * 8])
    np.testing.assert_array_equal(mb.positions[0, :15], list(range(10)) + list(range(5)))
    np.testing.assert_array_equal(mb.positions[1, :8], np.arange(8))
    np.testing.assert_array_equal(mb.tokens[0], prompt + comps[2] + prompt + comps[1] + [PAD])
    np.testing.assert_array_equal(mb.tokens[1], prompt + comps[0] + [PAD] * 8)
    np.testing.assert_array_equal(mb.loss_mask[0], [0] * 3 + [1] * 7 + [0, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(mb.behavior_logprobs[0, 3:10], behav[2])
    np.testing.assert_array_equal(mb.behavior_logprobs[0, 13:15], behav[1])
    np.testing.assert_array_equal(mb.behavior_logprobs[1, 3:8], behav[0])
    (padded,), padded_stats = build_microbatches([group], 16, 3, PAD, cfg)
    adv = padded.advantages  # the same group advantages, now on every token of their sequence
    np.testing.assert_array_equal(mb.advantages[0], [adv[2]] * 10 + [adv[1]] * 5 + [0])
    np.testing.assert_array_equal(mb.advantages[1], [adv[0]] * 8 + [0] * 8)
    assert stats["num_tokens"] == padded_stats["num_tokens"] == 14
    assert stats["packed_rows"] == 2 and stats["row_fill"] == 23 / 32
    assert host_count_sequences([mb]) == 3
    # the device format carries segment ids and per-token advantages exactly
    back = jax.jit(functools.partial(unpack_microbatch, segments=True))(pack_microbatch(mb))
    for name in ("tokens", "positions", "mask", "loss_mask", "behavior_logprobs", "advantages"):
        np.testing.assert_array_equal(np.asarray(getattr(back, name)), getattr(mb, name), err_msg=name)


def test_token_budget_sets_rows_and_microbatch_count_follows_real_tokens():
    groups = _groups(4, seed=3)
    mbs, stats = pack_microbatches(groups, T, 2, PAD, GRPOConfig())
    padded, _ = build_microbatches(groups, T, 2, PAD, GRPOConfig())
    assert all(np.asarray(mb.tokens).shape == (2, T) for mb in mbs)
    assert len(mbs) == -(-stats["packed_rows"] // 2) < len(padded)
    real = sum(int(np.count_nonzero(mb.mask)) for mb in mbs)
    assert real == sum(len(g.prompt_tokens) * G + len(g.completion_tokens.values) for g in groups)
    assert host_count_sequences(mbs) == 16


def test_long_completion_is_cut_at_the_row_length():
    group = rollout_group("g", "t", [1, 2], [[3] * 30, [4] * 3], [[-1.0] * 30, [-1.0] * 3], [1.0, 0.0], 0)
    (mb,), stats = pack_microbatches([group], 8, 2, PAD, GRPOConfig())
    assert stats["truncated_samples"] == 1 and stats["num_tokens"] == 6 + 3
    np.testing.assert_array_equal(mb.mask, [[1] * 8, [1] * 5 + [0] * 3])


def test_rows_per_microbatch_and_its_errors_name_the_key():
    assert rows_per_microbatch(100, 24) == 4
    assert rows_per_microbatch(96, 24, row_multiple=4) == 4
    with pytest.raises(ValueError, match=r"learner\.microbatch_tokens: 16 is less than one row of 24 tokens"):
        rows_per_microbatch(16, 24)
    with pytest.raises(ValueError, match=r"learner\.microbatch_tokens: .* 3 rows .* data x fsdp = 2"):
        rows_per_microbatch(72, 24, row_multiple=2)


@pytest.mark.parametrize("change, match", [
    (dict(microbatch_tokens=-1), "microbatch_tokens: must be >= 0"),
    (dict(microbatch_tokens=64, algorithm="ppo"), "microbatch_tokens: packing is built for grpo only"),
])
def test_bad_config_is_rejected_naming_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(LearnerConfig(), **change).validate()


def test_config_file_error_names_the_dotted_key():
    from cadence.launch.config import load_config
    from cadence.launch.config_loader import ConfigError
    with pytest.raises(ConfigError, match=r"learner\.microbatch_tokens: packing is built for grpo only"):
        load_config([], ["learner.algorithm=ppo", "learner.microbatch_tokens=512"])


# ---- segment reductions against NumPy ----


def test_segment_reductions_match_numpy():
    rng = np.random.default_rng(0)
    seg = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 2, 2, 2]], np.int32)
    mask = np.array([[0, 1, 1, 0, 1, 1, 0, 0], [0, 0, 1, 0, 1, 0, 0, 0]], np.float32)  # row 1 segment 2: none
    values = rng.normal(size=seg.shape).astype(np.float32)
    sums = np.asarray(segment_sums(jnp.asarray(values), jnp.asarray(seg)))
    means = np.asarray(sequence_mean(jnp.asarray(values), jnp.asarray(mask), jnp.asarray(seg)))
    for b in range(2):
        for s in range(4):
            sel = seg[b] == s
            np.testing.assert_allclose(sums[b, s], values[b][sel].sum(), atol=1e-6)
            m = mask[b][sel]
            want = (values[b][sel] * m).sum() / max(m.sum(), 1.0)
            if s > 0:
                np.testing.assert_allclose(means[b][sel], want, atol=1e-6)
    want = sum(1 for b in range(2) for s in range(1, 4) if mask[b][seg[b] == s].sum() > 0)
    assert int(sequences_with_tokens(jnp.asarray(mask), jnp.asarray(seg))) == want == 4


def test_attention_allowed_is_causal_within_the_segment_and_skips_padding():
    seg = jnp.asarray([[1, 1, 2, 2, 2, 0]], jnp.int32)
    allowed = np.asarray(llama.attention_allowed(seg))[0]
    want = np.zeros((6, 6), bool)
    want[0, 0] = want[1, :2] = True
    want[2, 2] = True
    want[3, 2:4] = want[4, 2:5] = True  # the padding query sees nothing (its output is unused)
    np.testing.assert_array_equal(allowed, want)
    # the bool mask is the one-segment case: unchanged from before
    bool_allowed = np.asarray(llama.attention_allowed(jnp.asarray([[True, True, False]])))[0]
    np.testing.assert_array_equal(bool_allowed, [[1, 0, 0], [1, 1, 0], [1, 1, 0]])


# ---- the model on packed rows ----


def _row_logprobs(mb):
    graphdef, params = _model()
    logits = jax.jit(functools.partial(llama.forward, graphdef))(
        params, jnp.asarray(mb.tokens), jnp.asarray(mb.positions), jnp.asarray(mb.mask))
    return np.asarray(token_logprobs(logits, jnp.asarray(mb.tokens), 1.0))


def test_no_leakage_between_packed_sequences_and_equal_to_each_alone():
    groups = _groups(2, seed=5, max_completion=6)
    (mb,), _ = pack_microbatches(groups, 96, 1, PAD, GRPOConfig())  # every sample in one row
    assert int(np.max(mb.mask)) == 8
    base = _row_logprobs(mb)
    # change every token of segment 3 (prompt and completion): nothing else moves
    changed = mb._replace(tokens=np.where(mb.mask == 3, (mb.tokens + 7) % MODEL.vocab_size, mb.tokens))
    after = _row_logprobs(changed)
    # a segment's first token is scored from the column before it, another segment's last token:
    # always a prompt token (loss mask 0); every other token of the other segments is unmoved
    other = (mb.mask > 0) & (mb.mask != 3) & (mb.positions > 0)
    np.testing.assert_allclose(after[other], base[other], atol=1e-6, rtol=0)
    assert np.abs(after[mb.mask == 3] - base[mb.mask == 3]).max() > 1e-3  # the change did reach segment 3
    # every completion token's log-prob equals the one from its own padded row
    padded, _ = build_microbatches(groups, 96, 8, PAD, GRPOConfig())
    alone = _row_logprobs(padded[0])
    for s in range(1, 9):
        cols = np.flatnonzero((mb.mask[0] == s) & (mb.loss_mask[0] > 0))
        seq = mb.tokens[0, mb.mask[0] == s]
        (i,) = [i for i in range(8) if np.array_equal(padded[0].tokens[i, : len(seq)], seq)
                and not padded[0].mask[i, len(seq):].any()]
        np.testing.assert_allclose(base[0, cols], alone[i, np.flatnonzero(padded[0].loss_mask[i] > 0)],
                                   atol=1e-5, rtol=0)


# ---- the train step ----

CASES = {
    "token_mean": dict(correction="coupled", entropy_coef=0.01),
    "seq_mean_token_mean": dict(correction="coupled", aggregation="seq_mean_token_mean"),
    "seq_sum_norm": dict(correction="coupled", aggregation="seq_sum_norm", aggregation_constant=12),
    "gspo_sequence_ratio": dict(correction="coupled", importance_level="sequence",
                                aggregation="seq_mean_token_mean", clip_low=3e-4, clip_high=4e-4),
    "decoupled_default": dict(),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_loss_and_gradients_equal_the_padded_layout(case):
    graphdef, params = _model()
    fwd = functools.partial(llama.forward, graphdef)
    groups = _groups(4, seed=11)
    padded_step = GRPOTrainStep(fwd, _cfg(**CASES[case]))
    packed_step = GRPOTrainStep(fwd, _cfg(microbatch_tokens=2 * T, **CASES[case]))
    padded, stats = build_microbatches(groups, T, 4, PAD, padded_step.cfg.grpo)
    packed, packed_stats = pack_microbatches(groups, T, 2, PAD, packed_step.cfg.grpo)
    n = stats["num_tokens"]
    assert packed_stats["num_tokens"] == n and len(packed) > 1  # several microbatches: global normalizers
    assert host_count_sequences(packed) == host_count_sequences(padded) == 16
    g_pad, m_pad = padded_step.accumulate_gradients(params, padded, n)
    g_pack, m_pack = packed_step.accumulate_gradients(params, packed, n)
    keys = padded_step.metric_keys
    assert keys == packed_step.metric_keys
    sums_pad, sums_pack = np.sum(m_pad, axis=0), np.sum(m_pack, axis=0)
    for i, key in enumerate(keys):
        np.testing.assert_allclose(sums_pack[i], sums_pad[i], atol=1e-5, rtol=1e-5, err_msg=key)
    assert abs(sums_pad[keys.index("loss")]) > 1e-3
    if case == "gspo_sequence_ratio":  # the tight sequence-level clip binds on some sequences
        assert 0 < sums_pad[keys.index("clip_frac")] < 1
    flat_pad, flat_pack = jax.tree.leaves(g_pad), jax.tree.leaves(g_pack)
    assert max(float(jnp.abs(x).max()) for x in flat_pad) > 1e-3
    for a, b in zip(flat_pad, flat_pack):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-5)


def test_a_new_microbatch_count_does_not_recompile():
    graphdef, params = _model()
    step = GRPOTrainStep(functools.partial(llama.forward, graphdef), _cfg(microbatch_tokens=2 * T))
    state = step.init(params)
    counts = []
    for k, num_groups in enumerate([4, 2, 3, 1]):
        mbs, stats = pack_microbatches(_groups(num_groups, seed=20 + k), T, 2, PAD, step.cfg.grpo)
        counts.append(len(mbs))
        state, metrics = step.update(state, mbs, stats["num_tokens"])
        assert np.isfinite(metrics["loss"])
    assert len(set(counts)) >= 3 and 1 in counts, counts
    sizes = step.cache_sizes()
    assert all(v == 1 for v in sizes.values()), sizes


# ---- units of whole groups (the noise scale's small batches) ----


def test_units_of_whole_groups_pack_into_microbatches_of_their_own():
    groups = _groups(5, seed=31)
    mbs, stats = layout_microbatches(groups, T, 4, 2 * T, PAD, GRPOConfig(), units=2)
    assert stats["unit_samples"] == [2 * G, 3 * G]  # 5 groups: 2 + 3, never a part of one
    first, second = stats["unit_microbatches"]
    assert first + second == len(mbs)
    # each unit's microbatches are exactly what packing its groups alone gives
    for unit, (a, b) in zip((groups[:2], groups[2:]), ((0, first), (first, len(mbs)))):
        alone, _ = pack_microbatches(unit, T, 2, PAD, GRPOConfig())
        assert len(alone) == b - a
        for got, want in zip(mbs[a:b], alone):
            for name in ("tokens", "mask", "positions", "loss_mask", "behavior_logprobs", "advantages"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    plain, plain_stats = layout_microbatches(groups, T, 4, 2 * T, PAD, GRPOConfig())
    assert "unit_microbatches" not in plain_stats and len(plain) <= len(mbs) <= len(plain) + 1
    one, one_stats = layout_microbatches(groups[:1], T, 4, 2 * T, PAD, GRPOConfig(), units=2)
    assert one_stats["unit_microbatches"] == [len(one)] and one_stats["unit_samples"] == [G]


@pytest.mark.parametrize("microbatch_size, want, samples", [
    (2, [2, 2, 2, 2, 2], [4] * 5),  # groups of 4 over 2 microbatches each: one group a unit
    (8, [1, 1, 1], [8, 8, 4]),  # 2 whole groups a microbatch: the microbatches are the units
    (4, [1] * 5, [4] * 5),
    (6, [2, 2], [12, 8]),  # a group and a microbatch end together every 12 samples
])
def test_padded_units_end_wherever_a_microbatch_and_a_group_end_together(microbatch_size, want, samples):
    groups = _groups(5, seed=32)  # 20 samples, groups of 4
    mbs, stats = layout_microbatches(groups, T, microbatch_size, 0, PAD, GRPOConfig(), units=2)
    assert stats["unit_microbatches"] == want and sum(want) == len(mbs)
    assert stats["unit_samples"] == samples
    # each unit's rows hold its samples (and padding), nothing of the next unit
    ends = np.cumsum(want) * microbatch_size
    assert all(e >= n for e, n in zip(ends, np.cumsum(samples))) and np.cumsum(samples)[-1] == 20
    assert split_units(5, 2, 2) == [2, 3] and split_units(1, 2) == [1] and split_units(8, 4) == [2, 2, 2, 2]


def test_unit_gradient_norms_are_each_unit_alone_and_the_update_is_unchanged():
    graphdef, params = _model()
    cfg = _cfg(microbatch_tokens=2 * T)
    step = GRPOTrainStep(functools.partial(llama.forward, graphdef), cfg)
    groups = _groups(4, seed=33)
    mbs, stats = layout_microbatches(groups, T, 4, 2 * T, PAD, cfg.grpo, units=2)
    units, n = stats["unit_microbatches"], stats["num_tokens"]
    assert max(units) > 1  # a unit of several microbatches: also summed apart (bf16), for its norm
    state, m = step.update(step.init(params), mbs, n, units=units)
    ends = np.cumsum([0, *units])
    for k, (a, b) in enumerate(zip(ends[:-1], ends[1:])):
        g, _ = step.accumulate_gradients(params, mbs[a:b], n)  # normalized by the whole batch's tokens
        want = sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree.leaves(g))
        assert m["unit_grad_norm_sq"][k] == pytest.approx(want, rel=1e-4)
        assert m["unit_tokens"][k] == sum(m["microbatch_tokens"][a:b])
    plain, m0 = step.update(step.init(params), mbs, n)  # the same update without units
    assert "unit_grad_norm_sq" not in m0 and m0["grad_norm_sq"] == pytest.approx(m["grad_norm_sq"], rel=1e-5)
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
    # units of one microbatch each are the microbatches' own norms; one unit is the batch's
    padded, pstats = layout_microbatches(groups, T, G, 0, PAD, cfg.grpo, units=4)
    pstep = GRPOTrainStep(functools.partial(llama.forward, graphdef), _cfg())
    _, m1 = pstep.update(pstep.init(params), padded, pstats["num_tokens"], units=pstats["unit_microbatches"])
    assert pstats["unit_microbatches"] == [1, 1, 1, 1] and m1["unit_grad_norm_sq"] == m1["microbatch_grad_norm_sq"]
    _, m2 = pstep.update(pstep.init(params), padded, pstats["num_tokens"], units=[len(padded)])
    assert m2["unit_grad_norm_sq"] == [pytest.approx(m2["grad_norm_sq"])]
    with pytest.raises(ValueError, match="units"):
        pstep.update(pstep.init(params), padded, pstats["num_tokens"], units=[1, 1])
