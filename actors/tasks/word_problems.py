"""Arithmetic word problems (task.name=word_problems): GSM8K-style problems from a seeded generator.

    cadence train model.path=CKPT task.name=word_problems task.format=chat task.max_ops=3

Problems (actors/tasks/word_problem_gen.py) have 1 to ``task.max_ops`` operations (+, -, *, exact
division; drawn uniformly) and non-negative integer answers. Prompt ``index`` of the training stream
is a pure function of (task.seed, index), as is each held-out problem of (task.heldout_seed, its
position); a training draw whose text is a held-out problem's is drawn again, so the two never
share a problem. The user message is ``task.prompt_template`` around the problem (default: the
problem, then an instruction to put the final answer in \\boxed{}), sent through the checkpoint's
chat template with task.format=chat. The reward is 1.0 iff the math verifier finds the answer in
the completion (\\boxed{N}, "#### N", "the answer is N", or else the last number), else 0.0; the
metric ``formatted`` says whether the completion used \\boxed{} or "#### N".
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence

from cadence.actors.tasks import math_verifier
from cadence.actors.tasks.base import Completion, Prompt, Score
from cadence.actors.tasks.config import TaskConfig
from cadence.actors.tasks.scoring import truncate_at_eos
from cadence.actors.tasks.text_prompt import check_text_tokenizer, encode_user_text
from cadence.actors.tasks.word_problem_gen import Problem, Tree, generate, solution

DEFAULT_TEMPLATE = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."
TRAIN_SPLIT, HELDOUT_SPLIT, CALIBRATION_SPLIT = "train", "heldout", "calibration"
# Length bounds (max_prompt_len, max_completion_len) come from this many draws plus a margin; a
# later draw over them is drawn again, so the bounds hold for the whole stream.
CALIBRATION_DRAWS = 512
LENGTH_MARGIN = 16
_MAX_REDRAWS = 128
_FORMATTED = re.compile(r"\\boxed\s*\{|####\s*\S")


def tree_as_lists(tree: Tree):
    """The tree as nested lists (JSON-friendly, for Prompt.metadata)."""
    return tree if isinstance(tree, int) else [tree[0], tree_as_lists(tree[1]), tree_as_lists(tree[2])]


class WordProblemsTask:
    """The Task protocol over generated word problems (see the module docstring)."""

    def __init__(self, cfg: TaskConfig, tokenizer) -> None:
        """cfg: a TaskConfig with name="word_problems"; tokenizer: the checkpoint's HFTokenizer."""
        cfg.validate()
        check_text_tokenizer(cfg, tokenizer, "word_problems")
        self.config, self.tokenizer = cfg, tokenizer
        self.name = "word_problems"
        self.template = cfg.prompt_template or DEFAULT_TEMPLATE
        self.max_prompt_len, self.max_completion_len = self._calibrate()
        # Held-out problems: sequential draws, repeats skipped, so a larger heldout_size extends
        # (never reshuffles) a smaller one.
        heldout: list[Prompt] = []
        self._heldout_texts: set[str] = set()
        draw = 0
        while len(heldout) < cfg.heldout_size:
            if draw > 4 * cfg.heldout_size + 1000:
                raise ValueError(f"heldout_size: {cfg.heldout_size} distinct problems not found in "
                                 f"{draw} draws with max_ops={cfg.max_ops}")
            built = self._draw_fitting(HELDOUT_SPLIT, cfg.heldout_seed, draw, len(heldout))
            draw += 1
            if built.text not in self._heldout_texts:
                self._heldout_texts.add(built.text)
                heldout.append(built)
        self._heldout = tuple(heldout)

    # ---- drawing --------------------------------------------------------------------------------

    def problem(self, split: str, seed: int, index: int, attempt: int = 0) -> Problem:
        """The problem of one draw: a pure function of its arguments and task.max_ops."""
        key = f"word_problems/{self.config.max_ops}/{split}/{seed}/{index}/{attempt}"
        rng = random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "little"))
        return generate(rng, rng.randint(1, self.config.max_ops))

    def _encode(self, problem: Problem) -> tuple[tuple[int, ...], tuple[int, ...]]:
        tok = self.tokenizer
        tokens = encode_user_text(self.config, tok, self.template.replace("{prompt}", problem.text))
        return tokens, (*tok.encode(solution(problem.tree)), tok.eos_id)

    def _calibrate(self) -> tuple[int, int]:
        lengths = [self._encode(self.problem(CALIBRATION_SPLIT, 0, i)) for i in range(CALIBRATION_DRAWS)]
        return (max(len(p) for p, _ in lengths) + LENGTH_MARGIN,
                max(len(a) for _, a in lengths) + LENGTH_MARGIN)

    def _draw_fitting(self, split: str, seed: int, index: int, position: int) -> Prompt:
        """The first attempt at draw `index` that fits the length bounds (and, for training, is
        not a held-out problem), as the Prompt at `position` of its split."""
        for attempt in range(_MAX_REDRAWS):
            problem = self.problem(split, seed, index, attempt)
            if split == TRAIN_SPLIT and problem.text in self._heldout_texts:
                continue
            tokens, answer = self._encode(problem)
            if len(tokens) <= self.max_prompt_len and len(answer) <= self.max_completion_len:
                return Prompt(f"{self.name}/{split}/{position}", position, tokens, answer, problem.text,
                              {"answer": problem.answer, "ops": problem.ops, "family": problem.family,
                               "tree": tree_as_lists(problem.tree)})
        raise RuntimeError(f"{self.name}: {_MAX_REDRAWS} redraws at {split} index {index}")

    # ---- the Task protocol ----------------------------------------------------------------------

    def prompt(self, index: int) -> Prompt:
        """Training prompt `index`, a pure function of (task.seed, index); never a held-out problem."""
        index = int(index)
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        return self._draw_fitting(TRAIN_SPLIT, self.config.seed, index, index)

    def heldout(self) -> list[Prompt]:
        """The fixed held-out set (a fresh list)."""
        return list(self._heldout)

    def is_heldout(self, prompt: Prompt) -> bool:
        """True iff the prompt's problem text is a held-out problem's."""
        return prompt.text in self._heldout_texts

    def score(self, prompt: Prompt, completion: Completion) -> Score:
        """Reward 1.0 iff the completion's final answer equals the problem's (exact match is the
        same verdict); metrics `formatted` (1.0 iff it used \\boxed{} or "#### N") and
        `verifier_refused`."""
        return _REWARD(prompt, completion)

    def scoring(self) -> "WordProblemReward":
        """What reward workers run: the reward alone (the answer is in prompt.metadata)."""
        return _REWARD

    def completion_text(self, completion: Sequence[int]) -> str:
        """The completion up to its first EOS, decoded without special tokens."""
        ids = truncate_at_eos(completion, self.tokenizer.eos_id)
        if ids and ids[-1] == self.tokenizer.eos_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def reward(self, prompt: Prompt, completion: Sequence[int]) -> float:
        """1.0 iff the completion's final answer is the problem's answer, else 0.0."""
        return self.score(prompt, Completion(tuple(completion), self.completion_text(completion))).reward

    def exact_match(self, prompt: Prompt, completion: Sequence[int]) -> bool:
        """The same verdict as the reward (a correct final answer)."""
        return self.reward(prompt, completion) == 1.0


class WordProblemReward(math_verifier.MathAnswerReward):
    """The verifier's verdict on metadata["answer"], plus the metric `formatted`."""

    def __call__(self, prompt: Prompt, completion: Completion) -> Score:
        score = super().__call__(prompt, completion)
        formatted = 1.0 if _FORMATTED.search(completion.text) else 0.0
        return Score(score.reward, score.exact_match, {**score.metrics, "formatted": formatted})


_REWARD = WordProblemReward("answer")
