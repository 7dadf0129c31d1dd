"""Per-token log-probabilities and entropies from next-token logits (pure jnp), whole or chunked.

token_logprobs / token_logprobs_and_entropy / logits_token_scores take [B, T, V] logits;
chunked_token_logprobs takes the hidden states and the output head and never builds [B, T, V]
(learner.logits_chunk), which at a 50-150k vocabulary is most of a step's activation memory."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


def _aligned(x: jax.Array) -> jax.Array:
    """[B, T-1] -> [B, T] with column 0 (no context) set to 0 (False for bool)."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Log p(tokens[:, t] | tokens[:, :t]) only: one logsumexp over the vocabulary, no softmax.

    Same alignment and temperature as token_logprobs_and_entropy; [B, T] float32.
    """
    return logits_token_scores(logits, tokens, temperature).logprobs


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
    scores = logits_token_scores(logits, tokens, temperature, entropy=True)
    return scores.logprobs, scores.entropy


class TokenScores(NamedTuple):
    """Per-token scores of a batch, each [B, T] and aligned with its tokens (column 0 is 0/False).

    Fields not asked for are None."""

    logprobs: jax.Array  # float32: log p(tokens[:, t] | tokens[:, :t])
    entropy: jax.Array | None = None  # float32: entropy of that distribution
    greedy: jax.Array | None = None  # bool: tokens[:, t] is its distribution's argmax


def _scores(z: jax.Array, targets: jax.Array, entropy: bool, greedy: bool) -> dict[str, jax.Array]:
    """z [..., V] float32 (already divided by the temperature), targets [...] -> unaligned scores."""
    lse = jax.nn.logsumexp(z, axis=-1)
    chosen = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    out = {"logprobs": chosen - lse}
    if entropy:  # H = lse - E_p[z]
        out["entropy"] = lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
    if greedy:
        out["greedy"] = jnp.argmax(z, axis=-1) == targets
    return out


def _aligned_scores(out: dict[str, jax.Array]) -> TokenScores:
    return TokenScores(**{k: _aligned(v) for k, v in out.items()})


def logits_token_scores(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0, *,
                        entropy: bool = False, greedy: bool = False) -> TokenScores:
    """TokenScores from whole [B, T, V] logits (the unchunked path); same math as
    token_logprobs_and_entropy, plus the optional greedy-hit flags."""
    z = logits[:, :-1].astype(jnp.float32) / temperature
    return _aligned_scores(_scores(z, tokens[:, 1:], entropy, greedy))


def chunked_token_logprobs(hidden: jax.Array, head_fn: Callable[[jax.Array], jax.Array],
                           tokens: jax.Array, temperature: float = 1.0, chunk: int = 0, *,
                           entropy: bool = False, greedy: bool = False) -> TokenScores:
    """Token log-probs (and optionally entropies, greedy hits) from hidden states, `chunk` positions
    at a time, so [B, T, V] logits never exist (learner.logits_chunk).

    The sequence is padded to a multiple of `chunk` and scanned as [nC, B, chunk, D] slices; each
    step maps its slice through `head_fn` (in the model's compute dtype), then takes a float32
    logsumexp. The step is rematerialised (jax.checkpoint): the backward pass recomputes a chunk's
    logits rather than keeping them, so the peak holds a few [B, chunk, V] buffers, not [B, T, V].
    Equal to logits_token_scores(head_fn(hidden), ...) up to float rounding; chunk <= 0, or a
    chunk covering the whole sequence, takes that unchunked path.

    Args:
      hidden: [B, T, D] final hidden states; hidden[:, t] predicts tokens[:, t + 1].
      head_fn: hidden [B, C, D] -> logits [B, C, V] (float32 or castable), e.g. the model's head.
      tokens: [B, T] int token ids.
      temperature: sampling temperature (> 0); logits are divided by it.
      chunk: positions per chunk along the sequence.
      entropy, greedy: also return those scores.

    Returns:
      TokenScores aligned with `tokens` (column 0 is 0 / False).
    """
    b, t, d = hidden.shape
    if chunk <= 0 or chunk >= t:
        return logits_token_scores(head_fn(hidden), tokens, temperature, entropy=entropy, greedy=greedy)
    n = -(-t // chunk)  # chunks
    pad = n * chunk - t
    # Position i scores tokens[:, i + 1]; the last position (and the padding) scores a dummy 0.
    targets = jnp.pad(tokens[:, 1:].astype(jnp.int32), ((0, 0), (0, 1 + pad)))
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))) if pad else hidden
    h = h.reshape(b, n, chunk, d).swapaxes(0, 1)  # [nC, B, C, D]
    y = targets.reshape(b, n, chunk).swapaxes(0, 1)  # [nC, B, C]

    # prevent_cse=False: inside scan the recomputation cannot be merged away (jax.checkpoint docs).
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def step(h_c, y_c):
        z = head_fn(h_c).astype(jnp.float32) / temperature  # [B, C, V]
        return _scores(z, y_c, entropy, greedy)

    _, out = jax.lax.scan(lambda carry, xs: (carry, step(*xs)), None, (h, y))
    # [nC, B, C] -> [B, T] (dropping the padding); column i scores token i + 1, so drop the last.
    out = {k: v.swapaxes(0, 1).reshape(b, n * chunk)[:, : t - 1] for k, v in out.items()}
    return _aligned_scores(out)
