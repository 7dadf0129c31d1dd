"""Math problems from a local JSONL file (GSM8K- or MATH-style), scored by answer equivalence.

Each line is a JSON object; ``task.prompt_field`` holds the problem and ``task.answer_field`` the
reference (GSM8K's "solution #### 72", MATH's solution with \\boxed{}, or a bare answer). The
held-out set is ``heldout_size`` records drawn with ``heldout_seed``; the training stream walks the
other records in a fresh seeded order each epoch, so prompt(index) is a pure function of
(seed, index). Rewards decode the completion and ask the math verifier, never eval.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cadence.actors.tasks import math_verifier
from cadence.actors.tasks.base import Completion, Prompt, Score
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.records import read_jsonl
from cadence.actors.tasks.scoring import truncate_at_eos
from cadence.actors.tasks.text_prompt import check_text_tokenizer, encode_user_text


class JsonlMathTask:
    """The Task protocol over a JSONL file of math problems.

    Prompt.answer holds the reference answer field's tokens plus EOS (what the supervised warm-up
    imitates); ``reward`` is 1.0 iff the decoded completion's final answer is equivalent to the
    reference, else 0.0.
    """

    def __init__(self, cfg: TaskConfig, tokenizer) -> None:
        """cfg: a validated TaskConfig with name="jsonl"; tokenizer: the checkpoint's HFTokenizer."""
        cfg.validate()
        check_text_tokenizer(cfg, tokenizer, "jsonl")
        self.config, self.tokenizer = cfg, tokenizer
        self.name = "jsonl"
        records = read_jsonl(cfg.path, (cfg.prompt_field, cfg.answer_field), key="path")
        n = len(records)
        if cfg.heldout_size >= n:
            raise ValueError(f"heldout_size: {cfg.heldout_size} leaves no training records of the {n} in "
                             f"{cfg.path}; set task.heldout_size below {n}")
        order = np.random.default_rng(cfg.heldout_seed).permutation(n)
        self._heldout_ids = order[: cfg.heldout_size].tolist()
        self._train_ids = sorted(order[cfg.heldout_size:].tolist())
        self._records = records
        self._encoded: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._reward = math_verifier.MathAnswerReward(cfg.answer_field)
        self._epoch_order: tuple[int, list[int]] | None = None
        # Lengths over every record: the stream may reach any of them.
        lengths = [self._encode(i) for i in range(n)]
        self.max_prompt_len = max(len(p) for p, _ in lengths)
        self.max_completion_len = max(len(a) for _, a in lengths)
        self._heldout = [self._build("heldout", j, i) for j, i in enumerate(self._heldout_ids)]

    def _encode(self, record_id: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        cached = self._encoded.get(record_id)
        if cached is not None:
            return cached
        record, cfg, tok = self._records[record_id], self.config, self.tokenizer
        text = (cfg.prompt_template or "{prompt}").replace("{prompt}", str(record[cfg.prompt_field]))
        tokens = encode_user_text(cfg, tok, text)
        answer = (*tok.encode(str(record[cfg.answer_field])), tok.eos_id)
        self._encoded[record_id] = (tokens, answer)
        return tokens, answer

    def _build(self, split: str, index: int, record_id: int) -> Prompt:
        tokens, answer = self._encode(record_id)
        record = self._records[record_id]
        return Prompt(prompt_id=f"{self.name}/{split}/{index}", index=index, tokens=tokens, answer=answer,
                      text=str(record[self.config.prompt_field]), metadata=record)

    def record_id(self, prompt: Prompt) -> int:
        """Index in the file of the record a prompt came from."""
        _, split, index = prompt.prompt_id.rsplit("/", 2)
        if split == "heldout":
            return self._heldout_ids[int(index)]
        return self._train_record(int(index))

    def _train_record(self, index: int) -> int:
        epoch, pos = divmod(index, len(self._train_ids))
        order = self._epoch_order  # one read: actor threads may replace it concurrently
        if order is None or order[0] != epoch:
            rng = np.random.default_rng([self.config.seed, epoch])
            order = self._epoch_order = (epoch, rng.permutation(self._train_ids).tolist())
        return order[1][pos]

    def prompt(self, index: int) -> Prompt:
        """Training prompt `index` (epoch index // n_train, in that epoch's seeded order)."""
        index = int(index)
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        return self._build("train", index, self._train_record(index))

    def heldout(self) -> list[Prompt]:
        """The fixed held-out set (a fresh list)."""
        return list(self._heldout)

    def reference(self, prompt: Prompt) -> math_verifier.Answer:
        """The parsed reference answer of a prompt's record (cached by the verifier)."""
        return math_verifier.parse_reference(str(prompt.metadata[self.config.answer_field]))

    def completion_text(self, completion: Sequence[int]) -> str:
        """The completion up to its first EOS, decoded without special tokens."""
        ids = truncate_at_eos(completion, self.tokenizer.eos_id)
        if ids and ids[-1] == self.tokenizer.eos_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def score(self, prompt: Prompt, completion: Completion) -> Score:
        """Reward 1.0 iff the final answer is equivalent to the reference; exact match is the same
        verdict (one verifier call per completion); metric verifier_refused."""
        return self._reward(prompt, completion)

    def scoring(self) -> math_verifier.MathAnswerReward:
        """What reward workers run: the reward alone, which reads the answer from the prompt's
        record (workers never load the dataset)."""
        return self._reward

    def reward(self, prompt: Prompt, completion: Sequence[int]) -> float:
        """1.0 iff the completion's final answer is equivalent to the reference, else 0.0."""
        return self.score(prompt, Completion(tuple(completion), self.completion_text(completion))).reward

    def exact_match(self, prompt: Prompt, completion: Sequence[int]) -> bool:
        """For math, "exact" means an equivalent final answer (the reward is already 0/1)."""
        return self.reward(prompt, completion) == 1.0
