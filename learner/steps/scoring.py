"""Token scores (log-probs, entropy) of a microbatch under a model, whole or chunked.

The train steps take a logits function (params, tokens, positions, mask) -> [B, T, V]. A plain one
is scored from its whole logits; a SplitLogits (hidden states + output head) can also be scored
chunk by chunk along the sequence (learner.logits_chunk), never holding [B, T, V].
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax

from cadence.learner.algorithms.logprobs import TokenScores, chunked_token_logprobs, logits_token_scores
from cadence.learner.models import llama


class SplitLogits(NamedTuple):
    """A logits function split at the final hidden states; calling it gives the whole logits."""

    hidden: Callable[..., jax.Array]  # (params, tokens, positions, mask) -> [B, T, D]
    head: Callable[[Any, jax.Array], jax.Array]  # (params, hidden [..., D]) -> float32 [..., V]

    def __call__(self, params, tokens, positions, mask) -> jax.Array:
        return self.head(params, self.hidden(params, tokens, positions, mask))


def llama_logits(graphdef, remat: str = "none") -> SplitLogits:
    """The Llama's logits function (learner.models.llama.forward), split for chunked scoring."""
    return SplitLogits(functools.partial(llama.hidden, graphdef, remat=remat),
                       functools.partial(llama.head_logits, graphdef))


def check_chunkable(logits_fn, chunk: int, seq_len: int) -> None:
    """Raises ValueError("logits_chunk: ...") if `chunk` would split rows of seq_len tokens but
    logits_fn cannot be chunked (a plain function: only its whole logits exist)."""
    if 0 < chunk < seq_len and not isinstance(logits_fn, SplitLogits):
        raise ValueError(f"logits_chunk: {chunk} splits rows of {seq_len} tokens, which needs the "
                         "model's hidden states and head apart (learner.steps.scoring.SplitLogits); "
                         "this step got a plain logits function: set logits_chunk=0")


def score_tokens(logits_fn, params, tokens, positions, mask, *, temperature: float = 1.0,
                 chunk: int = 0, entropy: bool = False, greedy: bool = False) -> TokenScores:
    """TokenScores [B, T] of `tokens` under logits_fn(params, ...), aligned with the tokens.

    0 < chunk < T (a SplitLogits only; see check_chunkable): `chunk` positions at a time under
    remat. Otherwise, the whole logits at once.
    """
    check_chunkable(logits_fn, chunk, tokens.shape[1])
    if 0 < chunk < tokens.shape[1]:
        h = logits_fn.hidden(params, tokens, positions, mask)
        return chunked_token_logprobs(h, functools.partial(logits_fn.head, params), tokens,
                                      temperature, chunk, entropy=entropy, greedy=greedy)
    return logits_token_scores(logits_fn(params, tokens, positions, mask), tokens, temperature,
                               entropy=entropy, greedy=greedy)
