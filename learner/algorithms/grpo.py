"""GRPO: group-relative advantages and the clipped token-level surrogate with off-policy correction.

Pure jnp functions, no model inside. The objective is built from small pieces so that later
objectives (PPO, DAPO, GSPO, ...) add a mode to a table instead of copying the loss:

  advantages   group_advantages                     rewards [N, G] -> advantages [N, G]
  correction   CORRECTIONS[cfg.correction]           logprobs -> (ratio, importance weight) [B, T]
  surrogate    clipped_surrogate                     ratio, advantage -> objective, clipped [B, T]
  aggregation  token_sum                             per-token values -> scalar (/ global tokens)
  diagnostics  mismatch_metrics, finalize_metrics    sampler vs learner mismatch, ESS

Every metric returned by `grpo_token_loss` is a masked token sum divided by the GLOBAL number of
completion tokens, so metrics (like the loss and its gradient) add up exactly over microbatches;
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


# ---- off-policy corrections: (logprobs, behavior, proximal, is_cap) -> (ratio, weight) [B, T] ----


def _capped_weight(log_weight: jax.Array, is_cap: float) -> jax.Array:
    weight = jnp.exp(jnp.clip(log_weight, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    return jnp.minimum(weight, is_cap) if is_cap > 0 else weight


def _decoupled(logprobs, behavior_logprobs, proximal_logprobs, is_cap):
    # AReaL: the trust region is around the proximal policy (the learner at the start of the step);
    # the sampler's staleness is corrected by a truncated, non-differentiated importance weight.
    ratio = jnp.exp(logprobs - proximal_logprobs)
    weight = _capped_weight(proximal_logprobs - behavior_logprobs, is_cap)
    return ratio, jax.lax.stop_gradient(weight)


def _coupled(logprobs, behavior_logprobs, proximal_logprobs, is_cap):
    # Standard PPO with the sampler as the old policy: the clip also bounds the staleness.
    del proximal_logprobs, is_cap
    ratio = jnp.exp(jnp.clip(logprobs - behavior_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    return ratio, jnp.ones_like(ratio)


def _no_correction(logprobs, behavior_logprobs, proximal_logprobs, is_cap):
    # Plain on-policy policy gradient: ratio == 1 with gradient d log pi; the sampler is ignored.
    del behavior_logprobs, proximal_logprobs, is_cap
    ratio = jnp.exp(logprobs - jax.lax.stop_gradient(logprobs))
    return ratio, jnp.ones_like(ratio)


Correction = Callable[[jax.Array, jax.Array, jax.Array, float], tuple[jax.Array, jax.Array]]
CORRECTIONS: dict[str, Correction] = {
    "decoupled": _decoupled,
    "coupled": _coupled,
    "none": _no_correction,
}


def clipped_surrogate(
    ratio: jax.Array, advantages: jax.Array, clip_low: float, clip_high: float
) -> tuple[jax.Array, jax.Array]:
    """PPO's pessimistic objective min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A).

    Written with a `where` rather than `minimum` so ties (r inside the clip range) take the
    unclipped branch with its exact gradient A * dr instead of a split subgradient.

    Args:
      ratio: [B, T] policy ratio r.
      advantages: [B, T] (or broadcastable) advantages A.
      clip_low, clip_high: the clip range around 1.

    Returns:
      (objective [B, T] to maximize, clipped [B, T] bool: where the clip is binding, i.e. the
      token's gradient is zeroed).
    """
    unclipped = ratio * advantages
    clipped_obj = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    clipped = clipped_obj < unclipped
    return jnp.where(clipped, clipped_obj, unclipped), clipped


def token_sum(values: jax.Array, loss_mask: jax.Array, num_tokens) -> jax.Array:
    """Token-level aggregation: sum over masked tokens / the global token count of the batch.

    Dividing by the whole batch's count (not the microbatch's) makes microbatch sums add up to the
    full-batch mean, for the loss, its gradient and the metrics alike.
    """
    return jnp.sum(values * loss_mask) / num_tokens


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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss of a (micro)batch: clipped surrogate, token-level aggregation, correction.

    loss = -sum_{masked t} w_t * min(r_t A, clip(r_t) A) / num_tokens - entropy_coef * mean entropy
    with (r, w) from CORRECTIONS[cfg.correction] (see GRPOConfig.correction).

    Args:
      logprobs: [B, T] learner log-probs of the tokens (differentiable).
      behavior_logprobs: [B, T] the sampler's log-probs of the same tokens (0 off the mask).
      advantages: [B] one advantage per sample (sequence), broadcast over its tokens.
      loss_mask: [B, T] 1.0 on completion tokens, 0 elsewhere (prompt, padding, padding rows).
      num_tokens: the GLOBAL number of completion tokens of the whole batch (all microbatches).
      cfg: GRPOConfig (clip_low, clip_high, correction, is_cap, entropy_coef are read).
      entropy: optional [B, T] per-token entropy; enables the entropy metric and bonus.
      proximal_logprobs: optional [B, T] log-probs of the proximal policy for "decoupled";
        default stop_gradient(logprobs) (one optimizer step per batch: the current policy).

    Returns:
      (loss scalar, metrics): metrics are additive over microbatches (token sums / num_tokens):
      pg_loss, clip_frac, ratio_mean, is_weight_mean, is_truncated_frac, entropy (if given) and
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

    ratio, weight = CORRECTIONS[cfg.correction](
        logprobs, behavior_logprobs, proximal_logprobs, cfg.is_cap
    )  # [B, T] each
    objective, clipped = clipped_surrogate(
        ratio, advantages.astype(jnp.float32)[:, None], cfg.clip_low, cfg.clip_high
    )  # [B, T]
    pg_loss = -token_sum(weight * objective, mask, num_tokens)
    loss = pg_loss

    sg = jax.lax.stop_gradient
    capped = cfg.correction == "decoupled" and cfg.is_cap > 0
    truncated = sg(weight) >= cfg.is_cap if capped else jnp.zeros_like(real)  # [B, T] bool
    metrics = {
        "pg_loss": sg(pg_loss),
        "clip_frac": token_sum(clipped.astype(jnp.float32), mask, num_tokens),
        "ratio_mean": token_sum(sg(ratio), mask, num_tokens),
        "is_weight_mean": token_sum(sg(weight), mask, num_tokens),
        "is_truncated_frac": token_sum(truncated.astype(jnp.float32), mask, num_tokens),
    }
    if entropy is not None:
        mean_entropy = token_sum(entropy, mask, num_tokens)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * mean_entropy
        metrics["entropy"] = sg(mean_entropy)
    metrics.update(mismatch_metrics(sg(logprobs), behavior_logprobs, mask, num_tokens))
    metrics["loss"] = sg(loss)
    return loss, metrics
