"""Shared machinery of the built-in digit tasks: hashed prompt streams, held-out set, scoring.

Each prompt is identified by an integer `number` in [0, space) that a subclass renders into
prompt text and answer text. Numbers come from BLAKE2b of (task, num_digits, split, seed, index,
attempt), so a prompt is a pure function of its index, identical across processes, platforms and
NumPy versions, and a resumed run continues at an index.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Sequence

from cadence.actors.tasks import scoring
from cadence.actors.tasks.base import Completion, Prompt, Score
from cadence.actors.tasks.config import TaskConfig, prompt_space_size
from cadence.learner.models.char_tokenizer import CharTokenizer  # the default tokenizer

TRAIN_SPLIT = "train"
HELDOUT_SPLIT = "heldout"
# With at most half the space held out, 128 straight collisions has probability <= 2**-128.
_MAX_REDRAWS = 128


class DigitTask(abc.ABC):
    """Base of tasks whose prompts and answers are fixed-length digit strings.

    Subclasses define only `_task_name` and `_render`; this class implements the Task protocol.
    """

    def __init__(self, cfg: TaskConfig, tokenizer=None) -> None:
        """tokenizer: CharTokenizer (the default) or a checkpoint's HFTokenizer."""
        cfg.validate()
        self.config = cfg
        self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer()
        digit_lengths = {len(self.tokenizer.encode(str(d))) for d in range(10)}
        if len(digit_lengths) != 1:  # fixed prompt/answer lengths rely on it
            raise ValueError(f"name: {cfg.name} needs a tokenizer that encodes every digit to the same "
                             f"number of tokens; this one uses {sorted(digit_lengths)}")
        self.name = self._task_name(cfg.num_digits)
        self._space = prompt_space_size(cfg.name, cfg.num_digits)

        # Held-out numbers: sequential draws from heldout_seed, duplicates skipped, so a larger
        # heldout_size extends (never reshuffles) a smaller one.
        numbers: list[int] = []
        seen: set[int] = set()
        draw = 0
        while len(numbers) < cfg.heldout_size:
            number = self._draw(HELDOUT_SPLIT, cfg.heldout_seed, draw, 0)
            draw += 1
            if number not in seen:
                seen.add(number)
                numbers.append(number)
        self._heldout_numbers = frozenset(seen)
        self._heldout = tuple(self._build(HELDOUT_SPLIT, i, n) for i, n in enumerate(numbers))
        self._heldout_tokens = frozenset(p.tokens for p in self._heldout)

        # Every prompt of a task renders to the same lengths, so one sample fixes them.
        sample = self._heldout[0]
        self.max_prompt_len = len(sample.tokens)
        self.max_completion_len = len(sample.answer)

    @abc.abstractmethod
    def _task_name(self, num_digits: int) -> str:
        """Short name used in prompt ids, e.g. "sort6" (must not contain "/")."""

    @abc.abstractmethod
    def _render(self, number: int) -> tuple[str, str]:
        """Maps a number in [0, space) to (prompt text, answer text without EOS)."""

    def _draw(self, split: str, seed: int, index: int, attempt: int) -> int:
        key = f"{self.config.name}/{self.config.num_digits}/{split}/{seed}/{index}/{attempt}"
        digest = hashlib.blake2b(key.encode(), digest_size=32).digest()
        # 256-bit value mod at most 10**24: the bias is far below anything measurable.
        return int.from_bytes(digest, "little") % self._space

    def _encode(self, text: str) -> list[int]:
        # Character by character: a BPE tokenizer would merge digit runs differently from prompt
        # to prompt, and the fixed lengths and slot-wise scoring need one token group per character.
        # For CharTokenizer this equals encode(text).
        return [t for char in text for t in self.tokenizer.encode(char)]

    def _build(self, split: str, index: int, number: int) -> Prompt:
        prompt_text, answer_text = self._render(number)
        tok = self.tokenizer
        bos = () if tok.bos_id is None else (tok.bos_id,)  # Qwen-style tokenizers have no BOS
        return Prompt(
            prompt_id=f"{self.name}/{split}/{index}",
            index=index,
            tokens=(*bos, *self._encode(prompt_text)),
            answer=(*self._encode(answer_text), tok.eos_id),
            text=prompt_text,
        )

    def prompt(self, index: int) -> Prompt:
        """Training prompt `index`, a pure function of (seed, index); never a held-out prompt.

        Raises:
          ValueError: if index is negative.
        """
        index = int(index)
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        for attempt in range(_MAX_REDRAWS):
            number = self._draw(TRAIN_SPLIT, self.config.seed, index, attempt)
            if number not in self._heldout_numbers:
                return self._build(TRAIN_SPLIT, index, number)
        raise RuntimeError(f"{self.name}: {_MAX_REDRAWS} held-out collisions at index {index}")

    def heldout(self) -> list[Prompt]:
        """The fixed held-out set (a fresh list; the Prompts themselves are immutable)."""
        return list(self._heldout)

    def is_heldout(self, prompt: Prompt) -> bool:
        """True iff the prompt's tokens are those of a held-out prompt."""
        return tuple(prompt.tokens) in self._heldout_tokens

    def score(self, prompt: Prompt, completion: Completion) -> Score:
        """Reward (see ``reward``) and exact match, from the ids."""
        return Score(self.reward(prompt, completion.ids), self.exact_match(prompt, completion.ids))

    def reward(self, prompt: Prompt, completion: Sequence[int]) -> float:
        """Per-slot partial credit (reward="partial") or 1.0/0.0 exact match (reward="exact")."""
        eos = self.tokenizer.eos_id
        if self.config.reward == "exact":
            return 1.0 if scoring.is_exact_match(prompt.answer, completion, eos) else 0.0
        return scoring.partial_credit(prompt.answer, completion, eos)

    def exact_match(self, prompt: Prompt, completion: Sequence[int]) -> bool:
        """True iff the completion equals prompt.answer up to and including EOS."""
        return scoring.is_exact_match(prompt.answer, completion, self.tokenizer.eos_id)
