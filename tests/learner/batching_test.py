"""build_microbatches: layout, alignment of behavior logprobs, padding rows, advantages, stats."""

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

from cadence.learner.batching import Microbatch, build_microbatches, pack_microbatch, unpack_microbatch
from cadence.learner.config import GRPOConfig

PAD = 0


class Group(NamedTuple):
    """Duck-typed stand-in for protocols.messages.RolloutGroup."""

    prompt_id: str
    task: str
    prompt_tokens: list
    completion_tokens: list
    behavior_logprobs: list
    rewards: list
    policy_version: int
    actor_id: str = "actor-0"
    timings: Any = None
    kept_logmass: Any = None


def _group(pid, prompt, completions, rewards, version=0):
    # Behavior logprob of completion i token j is -(10 i + j + 1) / 100: every value is distinct,
    # so a misalignment by one column cannot go unnoticed.
    behav = [[-(10 * i + j + 1) / 100 for j in range(len(c))] for i, c in enumerate(completions)]
    return Group(pid, "t", prompt, completions, behav, rewards, version)


def test_layout_alignment_and_padding_rows():
    g = _group("p", [1, 5, 6], [[7, 8], [9], [10, 11, 12]], [1.0, 0.0, 0.5], version=3)
    mbs, stats = build_microbatches([g], seq_len=8, microbatch_size=2, pad_id=PAD, grpo_cfg=GRPOConfig())
    assert len(mbs) == 2 and all(isinstance(mb, Microbatch) for mb in mbs)
    for mb in mbs:
        assert mb.tokens.shape == (2, 8) and mb.tokens.dtype == np.int32
        assert mb.positions.dtype == np.int32 and mb.mask.dtype == bool
        assert mb.loss_mask.dtype == np.float32 and mb.behavior_logprobs.dtype == np.float32
        assert mb.advantages.shape == (2,) and mb.advantages.dtype == np.float32
        np.testing.assert_array_equal(mb.positions, np.tile(np.arange(8), (2, 1)))
    tokens = np.concatenate([mb.tokens for mb in mbs])
    np.testing.assert_array_equal(tokens, [
        [1, 5, 6, 7, 8, 0, 0, 0],
        [1, 5, 6, 9, 0, 0, 0, 0],
        [1, 5, 6, 10, 11, 12, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],  # padding row
    ])
    mask = np.concatenate([mb.mask for mb in mbs])
    np.testing.assert_array_equal(mask, tokens != 0)
    loss_mask = np.concatenate([mb.loss_mask for mb in mbs])
    np.testing.assert_array_equal(loss_mask, [
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ])
    behav = np.concatenate([mb.behavior_logprobs for mb in mbs])
    # Each completion token sits at the same column as its behavior logprob.
    for i, completion in enumerate(g.completion_tokens):
        for j, tok in enumerate(completion):
            assert tokens[i, 3 + j] == tok
            assert behav[i, 3 + j] == np.float32(g.behavior_logprobs[i][j])
    assert np.all(behav[loss_mask == 0] == 0.0)
    adv = np.concatenate([mb.advantages for mb in mbs])
    r = np.array([1.0, 0.0, 0.5])
    np.testing.assert_allclose(adv[:3], (r - r.mean()) / (r.std() + 1e-6), rtol=1e-5)
    assert adv[3] == 0.0
    assert stats["num_tokens"] == 6 and stats["num_samples"] == 3 and stats["num_microbatches"] == 2
    assert stats["policy_version_min"] == stats["policy_version_max"] == 3
    np.testing.assert_allclose(stats["reward_mean"], 0.5)
    assert stats["truncated_samples"] == 0 and stats["completion_len_max"] == 3


def test_several_groups_of_different_sizes_and_scale_by_std_off():
    groups = [
        _group("a", [1], [[4], [5]], [1.0, 0.0], version=1),
        _group("b", [1, 2], [[4, 5], [6], [7]], [0.0, 0.0, 3.0], version=4),
        _group("c", [1], [[8], [9]], [0.2, 0.2], version=2),  # zero variance: no signal
    ]
    cfg = dataclasses.replace(GRPOConfig(), scale_by_std=False)
    mbs, stats = build_microbatches(groups, seq_len=4, microbatch_size=4, pad_id=PAD, grpo_cfg=cfg)
    adv = np.concatenate([mb.advantages for mb in mbs])
    np.testing.assert_allclose(adv[:7], [0.5, -0.5, -1.0, -1.0, 2.0, 0.0, 0.0], rtol=1e-6)
    assert np.all(adv[7:] == 0.0) and len(mbs) == 2
    assert stats["num_tokens"] == 8 and stats["num_groups"] == 3
    np.testing.assert_allclose(stats["zero_advantage_group_frac"], 1 / 3)
    assert (stats["policy_version_min"], stats["policy_version_max"]) == (1, 4)


def test_long_completion_is_cut_at_seq_len():
    g = _group("p", [1, 2], [[3, 4, 5, 6, 7], [8]], [1.0, 0.0])
    mbs, stats = build_microbatches([g], seq_len=4, microbatch_size=2, pad_id=PAD, grpo_cfg=GRPOConfig())
    np.testing.assert_array_equal(mbs[0].tokens[0], [1, 2, 3, 4])
    np.testing.assert_array_equal(mbs[0].loss_mask[0], [0, 0, 1, 1])
    np.testing.assert_allclose(mbs[0].behavior_logprobs[0], [0, 0, -0.01, -0.02], rtol=1e-6)
    assert stats["truncated_samples"] == 1 and stats["num_tokens"] == 3


def test_exact_multiple_adds_no_padding_row():
    g = _group("p", [1], [[2], [3], [4], [5]], [1.0, 2.0, 3.0, 4.0])
    mbs, _ = build_microbatches([g], seq_len=3, microbatch_size=2, pad_id=PAD, grpo_cfg=GRPOConfig())
    assert len(mbs) == 2 and all(mb.loss_mask.sum(axis=1).min() == 1 for mb in mbs)


def test_real_rollout_group_message():
    messages = pytest.importorskip("cadence.protocols.messages")
    timings = messages.EngineTimings(queued_at=0.0, started_at=0.0, finished_at=1.0,
                                     generate_seconds=1.0, num_tokens=3, engine="jax")
    g = messages.RolloutGroup(
        prompt_id="p0", task="sort", prompt_tokens=[1, 5], completion_tokens=[[6, 2], [7]],
        behavior_logprobs=[[-0.1, -0.2], [-0.3]], rewards=[1.0, 0.0], policy_version=2,
        actor_id="a0", timings=timings,
    )
    mbs, stats = build_microbatches([g], seq_len=4, microbatch_size=2, pad_id=PAD, grpo_cfg=GRPOConfig())
    np.testing.assert_array_equal(mbs[0].tokens, [[1, 5, 6, 2], [1, 5, 7, 0]])
    np.testing.assert_allclose(mbs[0].behavior_logprobs, [[0, 0, -0.1, -0.2], [0, 0, -0.3, 0]], rtol=1e-6)
    assert stats["num_tokens"] == 3 and stats["policy_version_mean"] == 2.0


@pytest.mark.parametrize("group,match", [
    (_group("long", [1, 2, 3, 4], [[5]], [1.0]), "prompt of 4 tokens"),
    (_group("empty", [], [[5]], [1.0]), "prompt of 0 tokens"),
    (Group("bad", "t", [1], [[5, 6]], [[-0.1]], [1.0], 0), "1 behavior logprobs"),
    (Group("bad", "t", [1], [[5]], [[-0.1]], [1.0, 0.0], 0), "2 rewards"),
])
def test_bad_groups_are_rejected(group, match):
    with pytest.raises(ValueError, match=match):
        build_microbatches([group], seq_len=4, microbatch_size=2, pad_id=PAD, grpo_cfg=GRPOConfig())
    with pytest.raises(ValueError, match="no groups"):
        build_microbatches([], seq_len=4, microbatch_size=2, pad_id=PAD, grpo_cfg=GRPOConfig())


def test_pack_unpack_round_trip_is_exact():
    g = _group("p", [1, 5], [[7, 8, 9], [3]], [0.25, -1.0])
    g = g._replace(behavior_logprobs=[[-1e-30, -3.7, -0.0], [-88.5]])  # tiny, negative zero, large
    (mb,), _ = build_microbatches([g], seq_len=6, microbatch_size=3, pad_id=PAD, grpo_cfg=GRPOConfig())
    packed = pack_microbatch(mb)
    assert packed.shape == (3, 5 * 6 + 1) and packed.dtype == np.int32
    back = jax.jit(unpack_microbatch)(packed)
    assert back.rewards is None  # GRPO's buffer carries no rewards
    with_rewards = pack_microbatch(mb, include_rewards=True)
    assert with_rewards.shape == (3, 5 * 6 + 2)
    back_r = jax.jit(lambda p: unpack_microbatch(p, has_rewards=True))(with_rewards)
    np.testing.assert_array_equal(np.asarray(back_r.rewards), [0.25, -1.0, 0.0])
    for name, want, got in zip(Microbatch._fields, mb, back_r):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got.view(np.int32) if got.dtype == np.float32 else got,
                                      want.view(np.int32) if want.dtype == np.float32 else want, err_msg=name)


@pytest.mark.parametrize("behavior", ["full", "nucleus"])
def test_top_p_kept_mass_gives_the_truncation_kl_and_optionally_the_behavior(behavior):
    # Group a carries the sampler's kept log-mass per token (top-p); group b does not (top_p = 1).
    kept = [[-0.1, -0.3], [-0.05], [0.0, -0.2, -0.4]]
    a = _group("a", [1, 5], [[7, 8], [9], [10, 11, 12]], [1.0, 0.0, 0.5])._replace(kept_logmass=kept)
    b = _group("b", [1], [[3, 4]], [0.0])
    cfg = dataclasses.replace(GRPOConfig(), behavior_logprobs=behavior)
    mbs, stats = build_microbatches([a, b], seq_len=6, microbatch_size=4, pad_id=PAD, grpo_cfg=cfg)
    # mean of -kept over the tokens that carry it (group a's 6 tokens): KL(top-p || full) per token
    np.testing.assert_allclose(stats["truncation_kl"], (0.1 + 0.3 + 0.05 + 0.2 + 0.4) / 6, rtol=1e-6)
    behav = np.asarray(mbs[0].behavior_logprobs)
    for row, (lps, ks) in enumerate(zip(a.behavior_logprobs, kept)):
        want = np.asarray(lps) - (np.asarray(ks) if behavior == "nucleus" else 0.0)
        np.testing.assert_allclose(behav[row, 2:2 + len(lps)], want, rtol=1e-6)
    np.testing.assert_allclose(behav[3, 1:3], b.behavior_logprobs[0], rtol=1e-6)  # no kept mass: as is
    _, no_kept = build_microbatches([b], seq_len=6, microbatch_size=4, pad_id=PAD, grpo_cfg=cfg)
    assert "truncation_kl" not in no_kept
