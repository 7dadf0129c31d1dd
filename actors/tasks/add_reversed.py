"""Reversed-digit addition: numbers are written least-significant digit first.

Example with num_digits=3: 123 + 456 = 579 is the prompt "321+654=" and the answer "9750" + EOS
(the sum zero-padded to num_digits + 1 digits, 0579, then reversed). Writing digits in reverse lets
a left-to-right model emit each sum digit after the operand digits and carry it depends on.
"""

from __future__ import annotations

from cadence.actors.tasks.digit_task import DigitTask


class AddReversedTask(DigitTask):
    """Add two num_digits-digit operands (each uniform in [0, 10**num_digits)), digits reversed.

    Prompt tokens: BOS, a reversed, "+", b reversed, "=" (2 * num_digits + 3 ids). Answer: a + b
    zero-padded to num_digits + 1 digits and reversed, EOS (num_digits + 2 ids).
    """

    def _task_name(self, num_digits: int) -> str:
        return f"add{num_digits}rev"

    def _render(self, number: int) -> tuple[str, str]:
        n = self.config.num_digits
        a, b = divmod(number, 10**n)
        prompt = str(a).zfill(n)[::-1] + "+" + str(b).zfill(n)[::-1] + "="
        return prompt, str(a + b).zfill(n + 1)[::-1]
