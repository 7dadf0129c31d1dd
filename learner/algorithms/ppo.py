"""PPO pieces: per-token rewards, GAE, the clipped value loss, KL estimators (pure jnp).

Token layout is that of learner.batching: row b holds prompt + completion + padding and
loss_mask[b, t] is 1 on the completion tokens the policy chose. In a multi-turn episode those are
not contiguous (tool output sits between turns, masked out): the policy's decisions are the masked
tokens in order, and the environment's tokens between two of them are part of the transition from
one to the next, so GAE runs over the masked tokens as one sequence, skipping the others.
values[b, t] is V of the state in which token t was chosen (the critic reads hidden[t - 1], like
logprobs read logits[t - 1]); the state after the last masked token is terminal (value 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def last_token_mask(loss_mask: jax.Array) -> jax.Array:
    """[B, T] float: 1 at each row's last masked token (all 0 for a row without tokens)."""
    mask = loss_mask.astype(jnp.float32)
    remaining = jnp.cumsum(mask[:, ::-1], axis=1)[:, ::-1]  # [B, T] masked tokens at t or later
    return mask * (remaining == 1.0)


def token_rewards(rewards: jax.Array, loss_mask: jax.Array, kl: jax.Array | None = None,
                  kl_coef: float = 0.0) -> jax.Array:
    """Per-token rewards: the verifiable reward on the last completion token, minus kl_coef * kl_t.

    Args:
      rewards: [B] the sequence's reward.
      loss_mask: [B, T] 1 on completion tokens.
      kl: optional [B, T] per-token KL estimate to the reference policy (reward shaping).
      kl_coef: its weight.

    Returns:
      [B, T] float32 rewards, 0 off the mask.
    """
    mask = loss_mask.astype(jnp.float32)
    out = last_token_mask(mask) * rewards.astype(jnp.float32)[:, None]  # [B, T]
    if kl is not None and kl_coef:
        out = out - kl_coef * kl * mask
    return out


def gae(token_rewards_: jax.Array, values: jax.Array, loss_mask: jax.Array, gamma: float,
        lam: float) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimation over each row's masked tokens, in order.

    With t' the next masked token after t: delta_t = r_t + gamma * V_t' - V_t (V after the last
    masked token is 0), A_t = delta_t + gamma * lam * A_t'; returns R_t = A_t + V_t are the value
    targets. Unmasked tokens between two masked ones (tool output) are skipped, not terminal.

    Args:
      token_rewards_: [B, T] per-token rewards (0 off the mask).
      values: [B, T] values aligned with the tokens (only masked entries are read).
      loss_mask: [B, T] 1 on the tokens the policy chose (contiguous for single-turn rows).
      gamma, lam: discount and GAE lambda.

    Returns:
      (advantages [B, T], returns [B, T]), both 0 off the mask.
    """
    mask = loss_mask.astype(jnp.float32)
    values = values.astype(jnp.float32) * mask
    rewards = token_rewards_.astype(jnp.float32) * mask

    def step(carry, x):  # reverse scan over time, one column [B] at a time
        next_adv, next_value = carry  # of the next masked token (0 after the last one)
        r, v, m = x
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        keep = m > 0  # an unmasked token passes the next masked token's values through
        carry = (jnp.where(keep, adv, next_adv), jnp.where(keep, v, next_value))
        return carry, adv * m

    zeros = jnp.zeros(mask.shape[0], jnp.float32)
    xs = (rewards.T, values.T, mask.T)  # [T, B] each
    _, adv_t = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    advantages = adv_t.T  # [B, T]
    return advantages, (advantages + values) * mask


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array,
               clip: float) -> jax.Array:
    """Per-token clipped value loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2).

    clip <= 0 gives the plain squared error 0.5 * (V - R)^2. Aggregate with the loss mask.
    """
    unclipped = jnp.square(values - returns)
    if clip <= 0:
        return 0.5 * unclipped
    clipped_values = old_values + jnp.clip(values - old_values, -clip, clip)
    return 0.5 * jnp.maximum(unclipped, jnp.square(clipped_values - returns))


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1 / k3).

    k1 = log pi - log ref (unbiased, can be negative); k3 = ref/pi - 1 - log(ref/pi) (unbiased,
    always >= 0, lower variance).
    """
    log_r = ref_logprobs - logprobs  # log(ref / pi)
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        log_r = jnp.clip(log_r, -20.0, 20.0)
        return jnp.exp(log_r) - 1.0 - log_r
    raise ValueError(f"kl estimator must be 'k1' or 'k3', got {estimator!r}")


def whiten(advantages: jax.Array, loss_mask: jax.Array, mean, std, eps: float = 1e-6) -> jax.Array:
    """(A - mean) / (std + eps) on the mask, 0 elsewhere (mean/std: global batch statistics)."""
    return (advantages - mean) / (std + eps) * loss_mask
