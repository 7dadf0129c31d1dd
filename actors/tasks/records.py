"""RecordsTask: a JSONL dataset plus a reward written as a plain Python function.

    # mytask.py, anywhere on PYTHONPATH
    from cadence.actors.tasks.records import RecordsTask

    def reward(prompt, completion):           # prompt.text, prompt.metadata (the record), completion.text
        return 1.0 if completion.text.strip() == prompt.metadata["answer"] else 0.0

    def make(cfg, tokenizer):
        return RecordsTask(cfg, tokenizer, reward)

    cadence train task.name=mytask:make task.args.path=data.jsonl task.args.prompt_field=question

task.args: path (the JSONL file), prompt_field (default "prompt"), answer_field (optional: its
text plus EOS becomes Prompt.answer, which the supervised warm-up imitates), template (text around
the prompt, "{prompt}" marks where; default "{prompt}"). The held-out set is task.heldout_size
records drawn with task.heldout_seed; training walks the others in a fresh seeded order each epoch.
The reward may return a number or a Score (reward, exact_match, metrics).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from cadence.actors.tasks.base import Completion, Prompt, Score


def read_jsonl(path: str, required: tuple[str, ...], key: str = "args.path") -> list[dict[str, Any]]:
    """The file's records (blank lines skipped).

    Raises:
      ValueError("<key>: <file>:<line>: ..."): invalid JSON, a record lacking a required field, or
        no records; key names the config key that gave the path.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{key}: {path}:{line_no}: invalid JSON ({e.msg})") from None
            missing = [k for k in required if not isinstance(record, dict) or k not in record]
            if missing:
                raise ValueError(f"{key}: {path}:{line_no}: record has no field {missing[0]!r}")
            records.append(record)
    if not records:
        raise ValueError(f"{key}: {path} holds no records")
    return records


class RecordsTask:
    """See the module docstring."""

    ARGS = ("path", "prompt_field", "answer_field", "template")

    def __init__(self, cfg, tokenizer, reward: Callable[[Prompt, Completion], float | Score],
                 name: str | None = None):
        args = dict(cfg.args)
        unknown = sorted(set(args) - set(self.ARGS))
        if unknown:
            raise ValueError(f"args.{unknown[0]}: unknown argument (expected {', '.join(self.ARGS)})")
        if not args.get("path"):
            raise ValueError("args.path: the JSONL file to read (task.args.path=FILE)")
        self.prompt_field = str(args.get("prompt_field", "prompt"))
        self.answer_field = args.get("answer_field") or None
        self.template = str(args.get("template", "{prompt}"))
        if "{prompt}" not in self.template:
            raise ValueError(f"args.template: must contain '{{prompt}}', got {self.template!r}")
        self.name = name or "records"
        self.tokenizer, self.reward_fn = tokenizer, reward
        required = (self.prompt_field,) + ((self.answer_field,) if self.answer_field else ())
        self.records = read_jsonl(str(args["path"]), required)
        n = len(self.records)
        if cfg.heldout_size >= n:
            raise ValueError(f"heldout_size: {cfg.heldout_size} leaves none of the {n} records to train on")
        order = np.random.default_rng(cfg.heldout_seed).permutation(n)
        self._heldout_ids = order[: cfg.heldout_size].tolist()
        self._train_ids = sorted(order[cfg.heldout_size:].tolist())
        self.seed = cfg.seed
        self._order: tuple[int, list[int]] | None = None  # this epoch's training order
        self._heldout = [self._build("heldout", i, r) for i, r in enumerate(self._heldout_ids)]
        lengths = [self._encode(r) for r in range(n)]
        self.max_prompt_len = max(len(p) for p, _ in lengths)
        self.max_completion_len = max((len(a) for _, a in lengths), default=0) or 1

    def _encode(self, rid: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        record, tok = self.records[rid], self.tokenizer
        text = self.template.replace("{prompt}", str(record[self.prompt_field]))
        bos = () if tok.bos_id is None else (tok.bos_id,)
        answer = ((*tok.encode(str(record[self.answer_field])), tok.eos_id) if self.answer_field else ())
        return (*bos, *tok.encode(text)), answer

    def _build(self, split: str, index: int, rid: int) -> Prompt:
        tokens, answer = self._encode(rid)
        text = self.template.replace("{prompt}", str(self.records[rid][self.prompt_field]))
        return Prompt(f"{self.name}/{split}/{index}", index, tokens, answer, text, self.records[rid])

    def prompt(self, index: int) -> Prompt:
        epoch, pos = divmod(int(index), len(self._train_ids))
        order = self._order  # one read: actor threads may replace it concurrently
        if order is None or order[0] != epoch:
            order = self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(
                self._train_ids).tolist())
        return self._build("train", int(index), order[1][pos])

    def heldout(self) -> list[Prompt]:
        return list(self._heldout)

    def score(self, prompt: Prompt, completion: Completion) -> float | Score:
        return self.reward_fn(prompt, completion)

    def scoring(self):
        """What reward workers run: the reward function alone, by reference (workers never read
        the dataset); None for a lambda or a closure, which workers get by building the task."""
        from cadence.actors.tasks.loading import function_ref
        return function_ref(self.reward_fn)
