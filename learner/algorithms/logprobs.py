"""Per-token log-probabilities and entropies from next-token logits (pure jnp)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _shifted(logits: jax.Array, tokens: jax.Array, temperature: float):
    z = logits[:, :-1].astype(jnp.float32) / temperature  # [B, T-1, V] predicts tokens[:, 1:]
    lse = jax.nn.logsumexp(z, axis=-1)  # [B, T-1]
    chosen = jnp.take_along_axis(z, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    return z, lse, chosen - lse


def _aligned(x: jax.Array) -> jax.Array:
    """[B, T-1] -> [B, T] with column 0 (no context) set to 0."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Log p(tokens[:, t] | tokens[:, :t]) only: one logsumexp over the vocabulary, no softmax.

    Same alignment and temperature as token_logprobs_and_entropy; [B, T] float32.
    """
    return _aligned(_shifted(logits, tokens, temperature)[2])


def token_logprobs_and_entropy(
    logits: jax.Array, tokens: jax.Array, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """Log p(tokens[:, t] | tokens[:, :t]) and the entropy of that distribution.

    logits[:, t] is the model's prediction for tokens[:, t + 1], so token t is scored by
    logits[:, t - 1]; column 0 (no context) is 0 in both outputs. Logits are divided by the
    sampling temperature so the learner scores tokens under the distribution the sampler drew from.
    The entropy needs the full [B, T, V] softmax (and its gradient, in a loss): use
    token_logprobs when it is not needed.

    Args:
      logits: [B, T, V] next-token logits.
      tokens: [B, T] int token ids.
      temperature: sampling temperature (> 0).

    Returns:
      (logprobs [B, T] float32, entropy [B, T] float32), aligned with `tokens`.
    """
    z, lse, logprobs = _shifted(logits, tokens, temperature)
    probs = jax.nn.softmax(z, axis=-1)  # [B, T-1, V]
    entropy = lse - jnp.sum(probs * z, axis=-1)  # [B, T-1]; H = lse - E_p[z]
    return _aligned(logprobs), _aligned(entropy)
