"""Rollout groups -> fixed-shape microbatches for the jitted train step (host-side NumPy).

Layout of one sample (row) of length seq_len:

  tokens             [p0 p1 .. pP-1 c0 c1 .. cC-1 pad .. pad]   prompt (as the actor encoded it,
                                                                 BOS included) + completion
  mask               [1  1  .. 1    1  1  .. 1    0   .. 0  ]   real tokens
  loss_mask          [0  0  .. 0    1  1  .. 1    0   .. 0  ]   completion tokens the policy sampled
  behavior_logprobs  [0  0  .. 0    b0 b1 .. bC-1 0   .. 0  ]   sampler's log p(c_j), aligned with c_j

A multi-turn episode (actors/episodes.py) is one row too: its completion holds every turn and the
environment's observations in order, and the group's ``policy_mask`` keeps the observations out of
loss_mask (they stay in tokens and mask: context for the tokens after them). Advantages are per
sample, so they reach only the loss_mask tokens; the loss normalizer num_tokens counts only those.

Token t's log-prob comes from logits[t - 1], so the prompt must hold at least one token. A
completion that does not fit is cut at seq_len (counted in stats["truncated_samples"]). Every
microbatch has exactly [microbatch_size, seq_len]; the last is filled with padding rows (all-zero
loss_mask), which contribute nothing, so the jitted step never sees a new shape.

With learner.microbatch_tokens > 0, learner/packing.py lays samples out several to a row instead
(segment ids in `mask`, positions restarting per sequence, per-token advantages).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from cadence.learner.algorithms.grpo import batch_std_advantages, group_advantages
from cadence.protocols.ragged import Ragged


class Microbatch(NamedTuple):
    """One fixed-shape microbatch (NumPy or device arrays)."""

    tokens: Any  # [M, T] int32: prompt + completion, right-padded with pad_id
    positions: Any  # [M, T] int32: arange(T) (packed rows: restarting at 0 for each sequence)
    # [M, T] bool: real (non-padding) tokens; packed rows: int32 segment ids (1..k, 0 = padding)
    mask: Any
    loss_mask: Any  # [M, T] float32: 1 on completion tokens
    behavior_logprobs: Any  # [M, T] float32: sampler log-probs aligned with tokens, 0 elsewhere
    advantages: Any  # [M] float32: one advantage per sample (packed rows: [M, T], per token)
    rewards: Any = None  # [M] float32: the sample's verifiable reward (PPO puts it on the last token)


def empty_microbatch(microbatch_size: int, seq_len: int, pad_id: int) -> Microbatch:
    """A microbatch of padding rows only (contributes nothing to the loss)."""
    m, t = microbatch_size, seq_len
    return Microbatch(
        tokens=np.full((m, t), pad_id, np.int32),
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (m, t)).copy(),
        mask=np.zeros((m, t), bool),
        loss_mask=np.zeros((m, t), np.float32),
        behavior_logprobs=np.zeros((m, t), np.float32),
        advantages=np.zeros((m,), np.float32),
        rewards=np.zeros((m,), np.float32),
    )


def _advantages_per_group(groups: Sequence[Any], grpo_cfg) -> list[np.ndarray]:
    """Group advantages, one [G] array per group; groups of equal size are computed together.

    With scale_by_std and std_scope "batch", every group is centered on its own mean and divided
    by the std of all centered rewards of the batch.
    """
    if grpo_cfg.scale_by_std and getattr(grpo_cfg, "std_scope", "group") == "batch":
        return batch_std_advantages([g.rewards for g in groups], grpo_cfg.std_eps)
    by_size: dict[int, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        by_size[len(group.rewards)].append(i)
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(groups)
    for size, idx in by_size.items():
        rewards = np.asarray([groups[i].rewards for i in idx], np.float32).reshape(len(idx), size)
        adv = group_advantages(rewards, grpo_cfg.scale_by_std, grpo_cfg.std_eps)  # NumPy path
        for row, i in enumerate(idx):
            out[i] = adv[row]
    return out


def _packed(g) -> tuple[Ragged, Ragged, Ragged | None, Ragged | None]:
    """(completion_tokens, behavior_logprobs, policy_mask, kept_logmass) of a group as Ragged: a
    RolloutGroup's own buffers (no copy); lists of rows (duck-typed groups) are packed."""
    tokens = Ragged.pack(g.completion_tokens, "int32")
    behavior = Ragged.pack(g.behavior_logprobs, "float32")
    if len(g.rewards) != len(tokens) or len(behavior) != len(tokens):
        raise ValueError(
            f"group {g.prompt_id!r}: {len(tokens)} completions, {len(g.rewards)} rewards, "
            f"{len(behavior)} behavior logprob lists"
        )
    if behavior.row_lengths != tokens.row_lengths:
        i = int(np.flatnonzero(behavior.lengths != tokens.lengths)[0])
        raise ValueError(f"group {g.prompt_id!r}: completion of {tokens.lengths[i]} tokens has "
                         f"{behavior.lengths[i]} behavior logprobs")
    policy, kept = getattr(g, "policy_mask", None), getattr(g, "kept_logmass", None)
    return (tokens, behavior, None if policy is None else Ragged.pack(policy, "bool"),
            None if kept is None else Ragged.pack(kept, "float32"))


def _packed_groups(groups: Sequence[Any], seq_len: int) -> list:
    """Each group's ragged arrays (_packed), after checking that every prompt fits a row of seq_len
    with room for a completion token (token t is scored from logits[t - 1])."""
    for g in groups:
        if not 0 < len(g.prompt_tokens) < seq_len:
            raise ValueError(
                f"group {g.prompt_id!r}: prompt of {len(g.prompt_tokens)} tokens needs "
                f"1 <= length < seq_len ({seq_len})"
            )
    return [_packed(g) for g in groups]

def build_microbatches(
    groups: Sequence[Any], seq_len: int, microbatch_size: int, pad_id: int, grpo_cfg
) -> tuple[list[Microbatch], dict]:
    """Lays out rollout groups as fixed-shape microbatches with their group advantages.

    Args:
      groups: RolloutGroup-like objects (prompt_tokens, completion_tokens, behavior_logprobs,
        rewards, policy_version, and policy_mask when present, are read).
      seq_len: T, the fixed row length (prompt + completion).
      microbatch_size: M, rows per microbatch.
      pad_id: token id of padding.
      grpo_cfg: GRPOConfig (scale_by_std, std_scope, std_eps, behavior_logprobs: "nucleus" uses
        logprob - kept_logmass as the behavior logprob of groups that carry kept_logmass).

    Returns:
      (microbatches, stats). stats: num_tokens (completion tokens kept that the policy sampled:
      the global normalizer of the loss), num_samples, num_groups, num_microbatches, reward_mean, reward_std,
      zero_advantage_group_frac (groups with equal rewards: no signal), completion_len_mean,
      completion_len_max, truncated_samples, policy_version_min / _max / _mean, and
      truncation_kl (mean -kept_logmass over the trained completion tokens: KL(top-p || full)
      per token) when any group carries kept_logmass.

    Raises:
      ValueError: empty input, a prompt that is empty or leaves no room in seq_len, or behavior
        logprobs / rewards whose lengths do not match the completions.
    """
    if not groups:
        raise ValueError("build_microbatches: no groups")
    packed = _packed_groups(groups, seq_len)

    advantages = _advantages_per_group(groups, grpo_cfg)
    num_samples = sum(len(tokens) for tokens, *_ in packed)
    num_mb = max(1, -(-num_samples // microbatch_size))
    rows = empty_microbatch(num_mb * microbatch_size, seq_len, pad_id)  # all rows, then split
    columns = np.arange(seq_len)

    nucleus = getattr(grpo_cfg, "behavior_logprobs", "full") == "nucleus"
    row, truncated, lengths, trained_tokens, truncation_kl = 0, 0, [], 0, []
    for g, (tokens, behavior, policy, kept), adv in zip(groups, packed, advantages):
        # Every completion of the group at once: flat copies from the packed buffers into the rows.
        prompt = np.asarray(g.prompt_tokens, np.int32)
        p, n = len(prompt), len(tokens)
        full = tokens.lengths.astype(np.int64)
        kept_len = np.minimum(full, seq_len - p)  # a completion that does not fit is cut
        truncated += int((kept_len < full).sum())
        within = np.arange(int(kept_len.sum())) - np.repeat(np.cumsum(kept_len) - kept_len, kept_len)
        src = np.repeat(tokens.offsets[:-1], kept_len) + within  # index into the packed values
        dst = (np.repeat(np.arange(row, row + n), kept_len), p + within)  # (row, column) in the batch
        block = slice(row, row + n)
        rows.tokens[block, :p] = prompt
        rows.tokens[dst] = tokens.values[src]
        rows.mask[block] = columns < (p + kept_len)[:, None]
        trained = np.ones(len(src), np.float32) if policy is None else policy.values[src].astype(np.float32)
        rows.loss_mask[dst] = trained
        behavior_values = behavior.values[src] * trained
        if kept is not None:
            kept_values = kept.values[src] * trained
            truncation_kl.append(-kept_values[trained > 0])
            if nucleus:  # the probability the token was drawn with
                behavior_values -= kept_values
        rows.behavior_logprobs[dst] = behavior_values
        rows.advantages[block] = adv
        rows.rewards[block] = g.rewards
        lengths.extend(kept_len.tolist())
        trained_tokens += int(trained.sum())
        row += n

    microbatches = [
        Microbatch(*(field[i * microbatch_size : (i + 1) * microbatch_size] for field in rows))
        for i in range(num_mb)
    ]
    return microbatches, batch_stats(groups, advantages, trained_tokens, num_samples, num_mb, lengths,
                                     truncated, truncation_kl)


def batch_stats(groups, advantages, trained_tokens: int, num_samples: int, num_mb: int, lengths,
                truncated: int, truncation_kl: list) -> dict:
    """The stats dict of a laid-out batch (see build_microbatches)."""
    rewards = np.concatenate([np.asarray(g.rewards, np.float64).reshape(-1) for g in groups])
    versions = np.asarray([g.policy_version for g in groups], np.int64)
    zero_adv = [bool(np.all(a == 0)) for a in advantages]
    stats = {
        "num_tokens": trained_tokens,
        "num_samples": num_samples,
        "num_groups": len(groups),
        "num_microbatches": num_mb,
        "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
        "reward_std": float(rewards.std()) if rewards.size else 0.0,
        "zero_advantage_group_frac": float(np.mean(zero_adv)),
        "completion_len_mean": float(np.mean(lengths)) if lengths else 0.0,
        "completion_len_max": int(max(lengths, default=0)),
        "truncated_samples": int(truncated),
        "policy_version_min": int(versions.min()),
        "policy_version_max": int(versions.max()),
        "policy_version_mean": float(versions.mean()),
    }
    if truncation_kl:
        stats["truncation_kl"] = float(np.concatenate(truncation_kl).mean())
    return stats


# ---- one-buffer transfer: a microbatch as a single int32 array [M, 5T + 1] (+1 with rewards) ----
# Six small host->device copies per microbatch cost more host time than the data is worth; the
# train step sends one packed buffer instead and unpacks it inside jit (float fields travel as
# their bit patterns, so the round trip is exact). Packed rows (segment ids, per-token advantages)
# travel as [M, 6T].


def _f32_bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.int32)


def pack_microbatch(mb: Microbatch, include_rewards: bool = False) -> np.ndarray:
    """[M, 5T + 1] int32: tokens | positions | mask | loss_mask bits | behavior bits | advantage
    bits; include_rewards appends a column of reward bits ([M, 5T + 2]; PPO needs them). Packed
    rows ([M, T] advantages): [M, 6T], the mask holding the segment ids."""
    advantages = _f32_bits(mb.advantages)
    fields = [
        np.asarray(mb.tokens, np.int32),
        np.asarray(mb.positions, np.int32),
        np.asarray(mb.mask, np.int32),
        _f32_bits(mb.loss_mask),
        _f32_bits(mb.behavior_logprobs),
        advantages if advantages.ndim == 2 else advantages[:, None],
    ]
    if include_rewards:
        rewards = mb.rewards if mb.rewards is not None else np.zeros(len(mb.advantages), np.float32)
        fields.append(_f32_bits(rewards)[:, None])
    return np.concatenate(fields, axis=1)


def unpack_microbatch(packed, has_rewards: bool = False, segments: bool = False) -> Microbatch:
    """Inverse of pack_microbatch (jnp; use inside jit). seq_len is (width - 1 - has_rewards) // 5,
    or with `segments` (packed rows, no rewards) width // 6."""
    bits = lambda x: lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
    if segments:
        t = packed.shape[1] // 6
        return Microbatch(
            tokens=packed[:, :t],
            positions=packed[:, t : 2 * t],
            mask=packed[:, 2 * t : 3 * t],  # int32 segment ids
            loss_mask=bits(packed[:, 3 * t : 4 * t]),
            behavior_logprobs=bits(packed[:, 4 * t : 5 * t]),
            advantages=bits(packed[:, 5 * t :]),  # [M, T]
        )
    t = (packed.shape[1] - 1 - int(has_rewards)) // 5
    return Microbatch(
        tokens=packed[:, :t],
        positions=packed[:, t : 2 * t],
        mask=packed[:, 2 * t : 3 * t] != 0,
        loss_mask=bits(packed[:, 3 * t : 4 * t]),
        behavior_logprobs=bits(packed[:, 4 * t : 5 * t]),
        advantages=bits(packed[:, 5 * t]),
        rewards=bits(packed[:, 5 * t + 1]) if has_rewards else None,
    )
