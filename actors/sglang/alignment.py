"""Checks that a /generate response is one aligned completion: ids, logprobs and length agree.

A server answers ``{"output_ids": [...], "meta_info": {"output_token_logprobs": [[logprob, id,
text], ...], "completion_tokens": n, "finish_reason": {...}}}``. The learner trusts every behavior
logprob to belong to the token beside it, so anything that does not line up is rejected (and the
prompt re-issued by the engine), never trimmed into shape.

One known server bug is undone, and only after checking it is exactly that bug: asked for output
logprobs only, sglang-jax 0.1.0rc0 never advances the offset of logprobs already sent, so each
partial output (every 50 tokens of a non-streaming request) repeats all logprobs so far and the
response holds prefixes of the completion's list followed by the whole list (64 tokens: 50 + 64
entries). See undo_repeated_prefixes.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple


class MisalignedResponse(ValueError):
    """The response's ids, logprobs and lengths disagree (a server bug; the prompt is re-issued)."""


class MalformedResponse(ValueError):
    """The response is not the JSON shape /generate promises (missing keys, wrong types)."""


class Completion(NamedTuple):
    tokens: list[int]  # completion ids, including the stop token if one ended it
    logprobs: list[float]  # behavior logprob of each id, same length
    finish_reason: str  # "length", "stop" or "abort" (as the server said)


def undo_repeated_prefixes(pairs: list[tuple[float, int]], n: int) -> list[tuple[float, int]] | None:
    """The last n pairs if everything before them is prefixes of them of growing length, else None.

    Args:
      pairs: (logprob, id) of each output_token_logprobs entry, as the server sent them.
      n: the completion's length (meta_info.completion_tokens).

    Returns:
      The completion's n pairs when ``pairs`` is exactly ``F[:k1] + F[:k2] + ... + F`` with
      0 < k1 < k2 < ... < n and F the last n pairs; None for any other shape.
    """
    if n <= 0 or len(pairs) <= n:
        return None
    final, rest = pairs[-n:], pairs[:-n]
    p, last_k = 0, 0
    while p < len(rest):
        # The longest prefix of final that starts at p and is followed by the end or by the next
        # chunk's start (every chunk starts with final[0]).
        k = 0
        while p + k < len(rest) and k < n and rest[p + k] == final[k]:
            k += 1
        while k > 0 and p + k < len(rest) and rest[p + k] != final[0]:
            k -= 1
        if k <= last_k or k >= n:
            return None
        p, last_k = p + k, k
    return final


def parse_completion(body: Any, max_new_tokens: int) -> Completion:
    """Validates one /generate response body and returns its aligned completion.

    Args:
      body: the decoded JSON of a non-streaming /generate call with return_logprob=true.
      max_new_tokens: what the request asked for (a longer completion is misaligned).

    Returns:
      Completion with len(tokens) == len(logprobs) == meta_info.completion_tokens.

    Raises:
      MalformedResponse: keys missing or of the wrong type.
      MisalignedResponse: the ids, logprobs and reported length do not agree (the message says how).
    """
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise MalformedResponse(f"response has no meta_info object: {str(body)[:200]}")
    meta = body["meta_info"]
    entries = meta.get("output_token_logprobs")
    n = meta.get("completion_tokens")
    if not isinstance(entries, list) or not isinstance(n, int):
        raise MalformedResponse("meta_info lacks output_token_logprobs (list) or completion_tokens (int); "
                                "was the request sent with return_logprob=true?")
    try:
        pairs = [(float(e[0]), int(e[1])) for e in entries]
    except (TypeError, ValueError, IndexError) as e:
        raise MalformedResponse(f"output_token_logprobs entries are not [logprob, id, ...]: {e}") from None
    reason = meta.get("finish_reason")
    reason = reason.get("type", "") if isinstance(reason, dict) else str(reason or "")
    if len(pairs) > n:  # sglang-jax's repeated prefixes (module docstring), only if exactly that
        pairs = undo_repeated_prefixes(pairs, n) or pairs
    if len(pairs) != n:
        raise MisalignedResponse(f"{len(pairs)} logprobs for {n} completion tokens")
    logprobs, ids = [lp for lp, _ in pairs], [i for _, i in pairs]
    output_ids = body.get("output_ids")
    if output_ids is not None and list(output_ids) != ids:
        raise MisalignedResponse(f"output_ids ({len(output_ids)} ids) differ from the ids beside the "
                                 f"logprobs ({len(ids)} ids); a server started without "
                                 "--skip-tokenizer-init reports its detokenizer's ids, which can drop some")
    if n > max_new_tokens:
        raise MisalignedResponse(f"{n} completion tokens, more than max_new_tokens={max_new_tokens}")
    if reason == "length" and n != max_new_tokens:
        raise MisalignedResponse(f"finish_reason 'length' after {n} of {max_new_tokens} tokens")
    if n == 0 and reason != "abort":
        raise MisalignedResponse("empty completion")
    bad = [lp for lp in logprobs if not (math.isfinite(lp) and lp <= 1e-4)]
    if bad:
        raise MisalignedResponse(f"logprobs must be finite and <= 0, got {bad[:3]}")
    return Completion(ids, logprobs, reason)
