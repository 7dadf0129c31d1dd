"""GRPO: group-relative advantages and the clipped token-level surrogate with off-policy correction.

Pure jnp functions, no model inside. The objective is built from small pieces so that later
objectives (PPO, DAPO, GSPO, ...) add a mode to a table instead of copying the loss:

  advantages   group_advantages                     rewards [N, G] -> advantages [N, G]
  correction   CORRECTIONS[cfg.correction]           logprobs -> (ratio, importance weight) [B, T]
  surrogate    clipped_surrogate                     ratio, advantage -> objective, clipped [B, T]
  importance   importance_ratio_and_weight           per token, or per sequence (GSPO)
  aggregation  AGGREGATIONS[cfg.aggregation]         per-token values -> scalar (global normalizers)
  diagnostics  mismatch_metrics, finalize_metrics    sampler vs learner mismatch, ESS

Every metric returned by `grpo_token_loss` is a masked token sum divided by the GLOBAL number of
completion tokens, and the loss is normalized by the GLOBAL token / sequence counts of the batch,
so metrics (like the loss and its gradient) add up exactly over microbatches;
`finalize_metrics` turns the sums into ratios that do not add up (the ESS).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# Log importance ratios are clamped to +-MAX_LOG_RATIO before exp so a token the sampler drew with
# vanishing probability cannot overflow float32 (exp(88) = inf).
MAX_LOG_RATIO = 20.0


def group_advantages(rewards: jax.Array, scale_by_std: bool = True, eps: float = 1e-6) -> jax.Array:
    """Group-relative advantages: rewards centered on their group mean (optionally / group std).

    The std is the population std (ddof=0). A group whose rewards are all equal carries no
    learning signal and gets exactly 0 advantages (no rounding residue from the mean).
    A NumPy input is computed with NumPy (host batching: no per-shape compilation when the number
    of groups changes); anything else with jnp (traceable).

    Args:
      rewards: [N, G] rewards of N groups of G completions of the same prompt.
      scale_by_std: divide by (std + eps) (GRPO); False keeps r - mean (Dr.GRPO).
      eps: added to the std before dividing.

    Returns:
      [N, G] float32 advantages (np.ndarray for NumPy input, else jax.Array).
    """
    xp = np if isinstance(rewards, (np.ndarray, list, tuple)) else jnp
    rewards = xp.asarray(rewards, xp.float32)  # [N, G]
    centered = rewards - xp.mean(rewards, axis=-1, keepdims=True)  # [N, G]
    if scale_by_std:
        std = xp.sqrt(xp.mean(centered**2, axis=-1, keepdims=True))  # [N, 1]
        centered = centered / (std + xp.float32(eps))
    constant = xp.max(rewards, axis=-1, keepdims=True) == xp.min(rewards, axis=-1, keepdims=True)
    return xp.where(constant, xp.float32(0.0), centered).astype(xp.float32)


def batch_std_advantages(rewards_per_group, eps: float = 1e-6) -> list[np.ndarray]:
    """Group-centered rewards divided by ONE std: that of all centered rewards of the batch (host).

    Groups may differ in size. A group with equal rewards stays exactly 0.

    Args:
      rewards_per_group: sequence of [G_i] reward arrays.
      eps: added to the batch std before dividing.

    Returns:
      list of [G_i] float32 advantages.
    """
    centered = [group_advantages(np.asarray(r, np.float32)[None], False)[0] for r in rewards_per_group]
    flat = np.concatenate(centered) if centered else np.zeros(0, np.float32)
    std = float(np.sqrt(np.mean(flat.astype(np.float64) ** 2))) if flat.size else 0.0
    return [(c / np.float32(std + eps)).astype(np.float32) for c in centered]


# ---- off-policy corrections: (logprobs, behavior, proximal) -> (log ratio, log weight | None) ----
# The ratio r is what the clip acts on (differentiable); the weight w multiplies the objective and
# is never differentiated. They are returned in log space so a sequence-level ratio (GSPO) is just
# the masked mean of the token log-ratios.


def _decoupled_log(logprobs, behavior_logprobs, proximal_logprobs):
    # AReaL: the trust region is around the proximal policy (the learner at the start of the step);
    # the sampler's staleness is corrected by a truncated, non-differentiated importance weight.
    return logprobs - proximal_logprobs, jax.lax.stop_gradient(proximal_logprobs - behavior_logprobs)


def _coupled_log(logprobs, behavior_logprobs, proximal_logprobs):
    # Standard PPO with the sampler as the old policy: the clip also bounds the staleness.
    del proximal_logprobs
    return logprobs - behavior_logprobs, None


def _no_correction_log(logprobs, behavior_logprobs, proximal_logprobs):
    # Plain on-policy policy gradient: ratio == 1 with gradient d log pi; the sampler is ignored.
    del behavior_logprobs, proximal_logprobs
    return logprobs - jax.lax.stop_gradient(logprobs), None


LogCorrection = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array | None]]
LOG_CORRECTIONS: dict[str, LogCorrection] = {
    "decoupled": _decoupled_log,
    "coupled": _coupled_log,
    "none": _no_correction_log,
}


def _capped_weight(log_weight: jax.Array, is_cap: float) -> jax.Array:
    weight = jnp.exp(jnp.clip(log_weight, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    return jnp.minimum(weight, is_cap) if is_cap > 0 else weight


def segment_sums(values: jax.Array, segments: jax.Array) -> jax.Array:
    """[B, T] values, [B, T] int segment ids (1..k per row, 0 = padding) -> [B, T]: column j of row
    b holds the sum of row b's values in segment j (a row has at most T segments, so T columns
    always suffice: one static shape however many sequences a row packs). A scatter-add, O(B T)."""
    rows = jnp.arange(values.shape[0])[:, None]  # [B, 1]
    return jnp.zeros_like(values).at[rows, segments].add(values)


def sequence_mean(values: jax.Array, loss_mask: jax.Array, segments: jax.Array | None = None
                  ) -> jax.Array:
    """The masked mean over each sequence's tokens (0 for a sequence without tokens).

    segments None (one sequence per row): [B, T] -> [B, 1]. With [B, T] int segment ids (packed
    rows): [B, T], every token carrying its own segment's mean.
    """
    if segments is None:
        lengths = jnp.sum(loss_mask, axis=-1, keepdims=True)  # [B, 1]
        return jnp.sum(values * loss_mask, axis=-1, keepdims=True) / jnp.maximum(lengths, 1.0)
    return jnp.take_along_axis(_segment_means(values, loss_mask, segments), segments, axis=1)  # [B, T]


def _segment_means(values, loss_mask, segments) -> jax.Array:
    """[B, T]: column j of row b holds the masked mean of segment j (0 for segments without
    tokens, padding's segment 0 included)."""
    return segment_sums(values * loss_mask, segments) / jnp.maximum(segment_sums(loss_mask, segments), 1.0)


def sequences_with_tokens(loss_mask: jax.Array, segments: jax.Array | None = None) -> jax.Array:
    """Sequences (rows, or segments of packed rows) holding at least one completion token, >= 1."""
    if segments is None:
        return jnp.maximum(jnp.sum(jnp.any(loss_mask > 0, axis=-1)), 1)
    return jnp.maximum(jnp.sum(segment_sums(loss_mask, segments) > 0), 1)


def importance_ratio_and_weight(
    logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    proximal_logprobs: jax.Array,
    loss_mask: jax.Array,
    correction: str,
    is_cap: float,
    level: str = "token",
    segments: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The ratio the clip acts on and the truncated importance weight, both [B, T].

    level "token": r_t = exp(log r_t), w_t = min(exp(log w_t), is_cap).
    level "sequence" (GSPO): every token of sequence b gets s_b = exp(mean_t log r_t) and
    min(exp(mean_t log w_t), is_cap), the length-normalized sequence likelihood ratio, whose
    gradient is s_b * mean_t d log pi_t. A sequence is a row, or with `segments` ([B, T] int
    segment ids of packed rows) one segment.

    Args:
      logprobs, behavior_logprobs, proximal_logprobs: [B, T] (0 off the mask).
      loss_mask: [B, T] float, 1 on completion tokens.
      correction: a key of LOG_CORRECTIONS.
      is_cap: cap of the weight; <= 0 disables it.
      level: "token" or "sequence".
      segments: optional [B, T] int segment ids (0 = padding) of packed rows.

    Returns:
      (ratio [B, T], weight [B, T] with no gradient; ones where the correction has none).
    """
    log_ratio, log_weight = LOG_CORRECTIONS[correction](logprobs, behavior_logprobs, proximal_logprobs)
    if level == "sequence":
        log_ratio = jnp.broadcast_to(sequence_mean(log_ratio, loss_mask, segments), log_ratio.shape)
        if log_weight is not None:
            log_weight = jnp.broadcast_to(sequence_mean(log_weight, loss_mask, segments),
                                          log_weight.shape)
    elif level != "token":
        raise ValueError(f"importance level must be 'token' or 'sequence', got {level!r}")
    ratio = jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    if log_weight is None:
        return ratio, jnp.ones_like(ratio)
    return ratio, jax.lax.stop_gradient(_capped_weight(log_weight, is_cap))


Correction = Callable[[jax.Array, jax.Array, jax.Array, float], tuple[jax.Array, jax.Array]]


def _token_level(name: str) -> Correction:
    def correction(logprobs, behavior_logprobs, proximal_logprobs, is_cap):
        ones = jnp.ones_like(logprobs)
        return importance_ratio_and_weight(
            logprobs, behavior_logprobs, proximal_logprobs, ones, name, is_cap, "token")
    return correction


# Token-level (ratio, weight) per correction name, for callers that do not need the level.
CORRECTIONS: dict[str, Correction] = {name: _token_level(name) for name in LOG_CORRECTIONS}


def clipped_surrogate(
    ratio: jax.Array, advantages: jax.Array, clip_low: float, clip_high: float,
    dual_clip: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """PPO's pessimistic objective min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A), dual-clipped.

    Written with a `where` rather than `minimum` so ties (r inside the clip range) take the
    unclipped branch with its exact gradient A * dr instead of a split subgradient.
    With dual_clip = c > 0 (dual-clip PPO, Ye et al. 2020; AReaL and verl use c = 3), a negative
    advantage's objective is max(that, c * A): min(r A, ...) is unbounded below as r grows, so a
    stale token the learner now likes far more than the sampler did (r up to e^20) would dominate
    the gradient; beyond r = c it contributes the constant c * A and no gradient.

    Args:
      ratio: [B, T] policy ratio r.
      advantages: [B, T] (or broadcastable) advantages A.
      clip_low, clip_high: the clip range around 1.
      dual_clip: c (> 1 + clip_high), or 0 for no dual clip.

    Returns:
      (objective [B, T] to maximize, clipped [B, T] bool: where a clip is binding, i.e. the
      token's gradient is zeroed).
    """
    unclipped = ratio * advantages
    clipped_obj = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    clipped = clipped_obj < unclipped
    objective = jnp.where(clipped, clipped_obj, unclipped)
    if dual_clip > 0:
        floor = dual_clip * advantages
        dual = (advantages < 0) & (floor > objective)
        objective = jnp.where(dual, floor, objective)
        clipped = clipped | dual
    return objective, clipped


def token_sum(values: jax.Array, loss_mask: jax.Array, num_tokens) -> jax.Array:
    """Token-level aggregation: sum over masked tokens / the global token count of the batch.

    Dividing by the whole batch's count (not the microbatch's) makes microbatch sums add up to the
    full-batch mean, for the loss, its gradient and the metrics alike.
    """
    return jnp.sum(values * loss_mask) / num_tokens


def seq_mean_token_mean(values, loss_mask, num_tokens, num_sequences, constant, segments=None
                        ) -> jax.Array:
    """Mean over each sequence's tokens, then sum / the global number of sequences."""
    del num_tokens, constant
    if segments is None:
        return jnp.sum(sequence_mean(values, loss_mask)) / num_sequences
    # Packed rows: one mean per segment (padding's segment 0 has no loss tokens and adds 0).
    return jnp.sum(_segment_means(values, loss_mask, segments)) / num_sequences


def seq_sum_norm(values, loss_mask, num_tokens, num_sequences, constant, segments=None) -> jax.Array:
    """Each sequence's token sum / a constant, then sum / the global number of sequences (Dr.GRPO)."""
    del num_tokens, segments  # the same total however sequences are laid out
    return jnp.sum(values * loss_mask) / (num_sequences * constant)


Aggregation = Callable[..., jax.Array]
# (values [B, T], loss_mask [B, T], num_tokens, num_sequences, constant, segments) -> scalar;
# num_tokens and num_sequences are GLOBAL counts (whole batch), so microbatch results add up to the
# batch value; segments: None (a sequence per row) or [B, T] int segment ids of packed rows.
AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": lambda v, m, n_tok, n_seq, c, seg=None: token_sum(v, m, n_tok),
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_sum_norm": seq_sum_norm,
}


def aggregate(values, loss_mask, cfg, num_tokens, num_sequences=None, completion_budget: int = 0,
              segments=None) -> jax.Array:
    """Aggregates per-token values with cfg.aggregation (GRPOConfig); see AGGREGATIONS.

    num_sequences defaults to the sequences of this (micro)batch that hold a completion token
    (rows, or with `segments` the segments of packed rows).
    seq_sum_norm divides each sequence's sum by cfg.aggregation_constant, or when that is 0 by
    completion_budget (the most tokens a completion may have: Dr.GRPO's generation budget, not
    the row length, which also holds the prompt and padding).
    """
    mode = getattr(cfg, "aggregation", "token_mean")
    if num_sequences is None:
        num_sequences = sequences_with_tokens(loss_mask, segments)
    constant = getattr(cfg, "aggregation_constant", 0) or completion_budget
    if mode == "seq_sum_norm" and not constant > 0:
        raise ValueError("aggregation_constant: seq_sum_norm divides by the completion budget; set "
                         "learner.grpo.aggregation_constant or pass completion_budget (engine.max_new_tokens)")
    return AGGREGATIONS[mode](values, loss_mask, num_tokens, num_sequences, float(constant), segments)


def mismatch_metrics(
    logprobs: jax.Array, behavior_logprobs: jax.Array, loss_mask: jax.Array, num_tokens
) -> dict[str, jax.Array]:
    """Sampler vs learner mismatch on the masked tokens (additive token sums / num_tokens).

    With rho = pi_learner / pi_behavior per token:
      logprob_diff_abs  mean |log pi_behavior - log pi_learner|
      mismatch_kl       k3 estimate of KL(behavior || learner): mean(rho - 1 - log rho) >= 0
      ess_weight_sum, ess_weight_sq_sum   mean(rho), mean(rho^2): inputs of the ESS (finalize_metrics)
    """
    log_rho = jnp.clip(logprobs - behavior_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO)  # [B, T]
    rho = jnp.exp(log_rho)
    return {
        "logprob_diff_abs": token_sum(jnp.abs(log_rho), loss_mask, num_tokens),
        "mismatch_kl": token_sum(rho - 1.0 - log_rho, loss_mask, num_tokens),
        "ess_weight_sum": token_sum(rho, loss_mask, num_tokens),
        "ess_weight_sq_sum": token_sum(rho**2, loss_mask, num_tokens),
    }


def finalize_metrics(metric_sums: dict) -> dict:
    """Adds the non-additive metrics to (possibly microbatch-summed) metrics.

    ess: effective sample size fraction of the behavior importance weights rho over the masked
    tokens, (sum rho)^2 / (N sum rho^2), in (0, 1]; 1 when sampler and learner agree.
    Works on jnp arrays or host floats.
    """
    out = dict(metric_sums)
    s, q = metric_sums["ess_weight_sum"], metric_sums["ess_weight_sq_sum"]
    out["ess"] = s * s / q if q > 0 else 1.0  # no tokens: nothing mismatched
    return out


def grpo_token_loss(
    logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    num_tokens,
    cfg,
    entropy: jax.Array | None = None,
    proximal_logprobs: jax.Array | None = None,
    num_sequences=None,
    completion_budget: int = 0,
    segments: jax.Array | None = None,
    clip: bool = True,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO-family loss of a (micro)batch: clipped surrogate, correction, aggregation.

    loss = -AGG_t[w_t * min(r_t A_t, clip(r_t) A_t)] - entropy_coef * mean entropy
    (the entropy's mean over every completion token, counted only on tokens whose advantage is
    nonzero when cfg.entropy_scope is "signal")
    (for A_t < 0 the min is floored at dual_clip * A_t when cfg.dual_clip > 0)
    with (r, w) from importance_ratio_and_weight (cfg.correction, cfg.importance_level) and AGG
    the aggregation cfg.aggregation (default token_mean: sum over masked tokens / num_tokens).

    Args:
      logprobs: [B, T] learner log-probs of the tokens (differentiable).
      behavior_logprobs: [B, T] the sampler's log-probs of the same tokens (0 off the mask).
      advantages: [B] one advantage per sample (broadcast over its tokens), or [B, T] per token
        (packed rows: each token carries its sequence's advantage).
      loss_mask: [B, T] 1.0 on completion tokens, 0 elsewhere (prompt, padding, padding rows).
      num_tokens: the GLOBAL number of completion tokens of the whole batch (all microbatches).
      cfg: GRPOConfig (clip_low, clip_high, dual_clip, correction, is_cap, entropy_coef,
        entropy_scope, aggregation, aggregation_constant, importance_level are read).
      entropy: optional [B, T] per-token entropy; enables the entropy metric and bonus (the train
        steps compute it only when cfg.entropy_coef > 0: it needs the full [B, T, V] softmax).
      proximal_logprobs: optional [B, T] log-probs of the proximal policy for "decoupled";
        default stop_gradient(logprobs) (one optimizer step per batch: the current policy).
      num_sequences: the GLOBAL number of sequences with completion tokens (sequence-level
        aggregations); default: those of this (micro)batch.
      completion_budget: the most tokens a completion may have (engine.max_new_tokens): the
        divisor of seq_sum_norm when cfg.aggregation_constant is 0.
      segments: optional [B, T] int segment ids of packed rows (1..k per row, 0 = padding): the
        sequence-level parts (aggregation, GSPO's sequence ratio, the default num_sequences) then
        treat each segment as its own sequence. None: one sequence per row.
      clip: False drops the clip and dual clip from the objective (w r A: the importance-weighted
        policy gradient, unbiased for the current policy's), as the batch-size controller's noise
        scale measures it on stale batches (GRPOTrainStep.update's unit_objective); the metrics
        still say where the clip would bind.

    Returns:
      (loss scalar, metrics): metrics are additive over microbatches (token sums / num_tokens):
      pg_loss, clip_frac (either clip binding), dual_clip_frac, ratio_mean, is_weight_mean,
      is_truncated_frac, entropy (if given), entropy_sampled (mean -log pi of the tokens) and
      those of mismatch_metrics; pass their microbatch sum to finalize_metrics for the ESS.
    """
    mask = loss_mask.astype(jnp.float32)  # [B, T]
    real = mask > 0
    # Off-mask positions (prompt, padding) get log-probs 0 so no exp/gradient there can be inf/nan.
    logprobs = jnp.where(real, logprobs, 0.0)
    behavior_logprobs = jnp.where(real, behavior_logprobs, 0.0)
    if proximal_logprobs is None:
        proximal_logprobs = jax.lax.stop_gradient(logprobs)
    else:
        proximal_logprobs = jnp.where(real, jax.lax.stop_gradient(proximal_logprobs), 0.0)

    level = getattr(cfg, "importance_level", "token")
    ratio, weight = importance_ratio_and_weight(
        logprobs, behavior_logprobs, proximal_logprobs, mask, cfg.correction, cfg.is_cap, level,
        segments)  # [B, T] each
    advantages = advantages.astype(jnp.float32)
    if advantages.ndim == 1:
        advantages = advantages[:, None]  # [B, 1]: one per sequence
    dual_clip = getattr(cfg, "dual_clip", 0.0)
    objective, clipped = clipped_surrogate(ratio, advantages, cfg.clip_low, cfg.clip_high,
                                           dual_clip)  # [B, T]
    if not clip:
        objective = ratio * advantages
    pg_loss = -aggregate(weight * objective, mask, cfg, num_tokens, num_sequences, completion_budget,
                         segments)
    loss = pg_loss

    sg = jax.lax.stop_gradient
    capped = cfg.correction == "decoupled" and cfg.is_cap > 0
    truncated = sg(weight) >= cfg.is_cap if capped else jnp.zeros_like(real)  # [B, T] bool
    metrics = {
        "pg_loss": sg(pg_loss),
        "clip_frac": token_sum(clipped.astype(jnp.float32), mask, num_tokens),
        # the share of tokens the dual clip silenced (A < 0, r > c): stale tokens it kept out
        "dual_clip_frac": token_sum(((advantages < 0) & (ratio > dual_clip) & (dual_clip > 0))
                                    .astype(jnp.float32), mask, num_tokens),
        "ratio_mean": token_sum(sg(ratio), mask, num_tokens),
        "is_weight_mean": token_sum(sg(weight), mask, num_tokens),
        "is_truncated_frac": token_sum(truncated.astype(jnp.float32), mask, num_tokens),
    }
    # -log pi of the sampled tokens: an estimate of the entropy that costs nothing (exact in
    # expectation when the tokens come from the learner's own policy; staleness biases it).
    metrics["entropy_sampled"] = token_sum(-sg(logprobs), mask, num_tokens)
    if entropy is not None:
        mean_entropy = token_sum(entropy, mask, num_tokens)
        if cfg.entropy_coef:
            bonus = mean_entropy
            if cfg.entropy_scope == "signal":  # only where the policy gradient acts
                bonus = token_sum(entropy, mask * (advantages != 0), num_tokens)
            loss = loss - cfg.entropy_coef * bonus
        metrics["entropy"] = sg(mean_entropy)
    metrics.update(mismatch_metrics(sg(logprobs), behavior_logprobs, mask, num_tokens))
    metrics["loss"] = sg(loss)
    return loss, metrics
