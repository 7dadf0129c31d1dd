"""A calculator tool on multi-digit addition: a multi-turn task for Cadence (docs/tasks.md).

The prompt is "123+456=". Each model turn ends at EOS and is either
  - a tool call: "c" evaluates the question, "c12+345" (digits, + and -) any expression; the
    environment answers with the observation ":579" (tokens that enter the context, masked out
    of the loss), and the model takes another turn; or
  - a final answer "579": the episode ends, rewarded by the fraction of the sum's digits right
    (position by position, over the longer of answer and sum).
A malformed call gets ":err". At most ``max_turns`` turns. Metrics: tool_use (a valid call was
made), correct (the answer is exact).

The supervised warm-up (Prompt.answer) shows two ways to answer: the direct sum ("57" EOS), or,
for one prompt in four, the transcript of a tool episode ("c" EOS ":57" "57" EOS: the call, the
tool's answer, the copied answer). The tool's answer is in the transcript's context but out of the
warm-up's loss (Prompt.answer_mask), as observations are out of the RL loss: the model learns to
call and to copy, never to write the tool's output itself. A warmed-up model calls the tool less
than half the time (0.34-0.40 greedy on the held-out set) and adds two-digit numbers poorly by itself;
RL finds that the tool pays, and learns to copy its answer: the tool-use rate and the reward rise
together.

    cadence train --config examples/calculator/config.yaml
"""
from __future__ import annotations

import re

import numpy as np

from cadence import Prompt, Step

CALL = re.compile(r"c(?:(\d{1,9})([+-])(\d{1,9}))?")


def _digit_credit(answer: str, target: str) -> float:
    width = max(len(answer), len(target))
    return sum(a == t for a, t in zip(answer, target)) / width if width else 0.0


class CalculatorEnv:
    def __init__(self, task: "CalculatorTask", prompt: Prompt):
        self.task, self.target = task, str(prompt.metadata["sum"])
        self.question = (prompt.metadata["a"], "+", prompt.metadata["b"])
        self.used = False

    def step(self, turn) -> Step:
        text = turn.text
        if text.startswith("c"):
            call = CALL.fullmatch(text)
            if call is None:
                return Step(self.task.encode(":err"), metrics={"tool_use": 0.0})
            a, op, b = self.question if call.group(1) is None else (int(call.group(1)), call.group(2),
                                                                    int(call.group(3)))
            first = not self.used
            self.used = True
            return Step(self.task.encode(":" + str(a + b if op == "+" else a - b)),
                        metrics={"tool_use": 1.0 if first else 0.0})
        correct = text == self.target
        return Step(reward=_digit_credit(text, self.target), done=True, metrics={"correct": float(correct)})


class CalculatorTask:
    """Task + environment factory (see the module docstring)."""

    def __init__(self, cfg, tokenizer):
        args = dict(cfg.args)
        self.digits = int(args.pop("digits", 3))
        self.max_turns = int(args.pop("max_turns", 3))
        if args:
            raise ValueError(f"args.{sorted(args)[0]}: unknown argument (expected digits, max_turns)")
        if not 1 <= self.digits <= 6:
            raise ValueError(f"args.digits: must be in 1..6, got {self.digits}")
        self.name = f"calc{self.digits}"
        self.tokenizer = tokenizer
        self.seed, self.heldout_seed, self.heldout_size = cfg.seed, cfg.heldout_seed, cfg.heldout_size
        n = self.digits
        self.max_prompt_len = 1 + 2 * n + 2  # BOS a + b =
        # a call (c EOS), its observation (: sum), the answer (sum EOS), with room to spare
        self.max_completion_len = 2 + (n + 2) + (n + 2) + 4

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def _make(self, split: str, index: int, seed: int) -> Prompt:
        a, b = (int(x) for x in np.random.default_rng([seed, index]).integers(0, 10 ** self.digits, 2))
        text = f"{a}+{b}="
        # warm-up target: one prompt in four shows a tool episode's transcript, the others a direct answer
        eos = self.tokenizer.eos_id
        if index % 4 == 0:  # the model's call, the tool's answer (not trained on: the model never
            call, tool, final = (*self.encode("c"), eos), self.encode(f":{a + b}"), (*self.encode(str(a + b)), eos)
            shown, trained = (*call, *tool, *final), (True,) * len(call) + (False,) * len(tool) + (True,) * len(final)
        else:  # writes it), its copied answer; or the direct answer
            shown, trained = (*self.encode(str(a + b)), eos), ()
        return Prompt(f"{self.name}/{split}/{index}", index, (self.tokenizer.bos_id, *self.encode(text)),
                      answer=shown, answer_mask=trained, text=text,
                      metadata={"a": a, "b": b, "sum": a + b})

    def prompt(self, index: int) -> Prompt:
        return self._make("train", index, self.seed)

    def heldout(self) -> list[Prompt]:
        # Drawn from another seed: with 10^(2n) possible prompts, overlap with training is negligible.
        return [self._make("heldout", i, self.heldout_seed + 1_000_003) for i in range(self.heldout_size)]

    def environment(self, prompt: Prompt) -> CalculatorEnv:
        return CalculatorEnv(self, prompt)


def make(cfg, tokenizer):
    return CalculatorTask(cfg, tokenizer)
