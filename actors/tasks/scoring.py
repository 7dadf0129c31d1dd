"""Verifiers that score completions from token ids (never from decoded text)."""

from __future__ import annotations

from collections.abc import Sequence


def truncate_at_eos(completion: Sequence[int], eos_id: int) -> list[int]:
    """Returns the completion up to and including its first EOS (all of it if there is none)."""
    ids = [int(t) for t in completion]  # accepts NumPy arrays; ints compare exactly
    try:
        return ids[: ids.index(eos_id) + 1]
    except ValueError:
        return ids


def slot_matches(answer: Sequence[int], completion: Sequence[int], eos_id: int) -> int:
    """Counts answer slots j (digits and the final EOS) where completion[j] == answer[j].

    Tokens after the completion's first EOS are ignored; missing slots (too short) count as wrong,
    so a junk id where EOS belongs earns no EOS credit.
    """
    kept = truncate_at_eos(completion, eos_id)
    return sum(1 for j, target in enumerate(answer) if j < len(kept) and kept[j] == int(target))


def is_exact_match(answer: Sequence[int], completion: Sequence[int], eos_id: int) -> bool:
    """True iff the completion equals the answer up to and including EOS."""
    return truncate_at_eos(completion, eos_id) == [int(t) for t in answer]


def partial_credit(answer: Sequence[int], completion: Sequence[int], eos_id: int) -> float:
    """Fraction of the len(answer) slots the completion gets right, in [0, 1]."""
    if not answer:
        raise ValueError("partial_credit: answer must not be empty")
    return slot_matches(answer, completion, eos_id) / len(answer)
