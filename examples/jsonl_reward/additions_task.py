"""A JSONL dataset with a format + correctness reward written as a plain Python function.

    cadence train --config examples/jsonl_reward/config.yaml    (from the repository root)

Each record of additions.jsonl is {"question": "37+25=", "answer": "62"}. The reward reads the
decoded completion: 0.2 for the format (only digits, ended by EOS), plus 0.8 times the fraction of
the answer's digits in the right place; exact_match is the whole answer right (so held-out exact
match and run.stop_at_exact_match work as for the built-in tasks).
"""
from __future__ import annotations

from cadence import RecordsTask, Score


def reward(prompt, completion) -> Score:
    text, answer = completion.text, prompt.metadata["answer"]
    ended = prompt.answer[-1:] and completion.ids[-1:] == prompt.answer[-1:]  # stopped at EOS
    well_formed = bool(ended and text.isdigit())
    width = max(len(text), len(answer))
    digits = sum(a == b for a, b in zip(text, answer)) / width if width else 0.0
    return Score(0.2 * well_formed + 0.8 * digits, exact_match=bool(ended) and text == answer,
                 metrics={"well_formed": float(well_formed)})


def make(cfg, tokenizer):
    return RecordsTask(cfg, tokenizer, reward, name="additions")
