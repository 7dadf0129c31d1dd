"""Segment ids of packed rows: which sequence a token belongs to, and which shared prompt it sees.

A packed row's int mask (learner/packing.py) gives each token one number:

    mask = prefix * PREFIX_STRIDE + sequence        0 = padding

sequence (1..k within the row) is the token's own sequence; prefix is 0, or the sequence id of a
prompt prefix shared by a GRPO group's completions in that row (learner.share_prompts): such a
token attends to its own sequence and, before it, to that prefix. Without sharing every prefix is
0 and the mask is the plain segment ids. Works on NumPy and JAX integer arrays alike.

    sequence_ids(mask)     # what the loss treats as sequences (segment sums, counts)
    prefix_ids(mask)       # what attention also lets a token see
"""

from __future__ import annotations

PREFIX_STRIDE = 1 << 16  # rows are shorter than this, so a row's sequence ids fit below it


def encode(sequence, prefix=0):
    """The mask value of a token of `sequence` that also sees the shared prefix `prefix` (0: none)."""
    return prefix * PREFIX_STRIDE + sequence


def sequence_ids(mask):
    """[.., T] int mask -> the sequence id of each token (0 = padding)."""
    return mask % PREFIX_STRIDE


def prefix_ids(mask):
    """[.., T] int mask -> the sequence id of the prefix each token also sees (0 = none)."""
    return mask // PREFIX_STRIDE
