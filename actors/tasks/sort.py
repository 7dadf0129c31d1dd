"""Sorting task: "583920>" -> "023589" + EOS."""

from __future__ import annotations

from cadence.actors.tasks.digit_task import DigitTask


class SortTask(DigitTask):
    """Sort num_digits random decimal digits (repeats allowed) in ascending order.

    Prompt tokens: BOS, the digits, ">" (num_digits + 2 ids). Answer: the sorted digits, EOS
    (num_digits + 1 ids).
    """

    def _task_name(self, num_digits: int) -> str:
        return f"sort{num_digits}"

    def _render(self, number: int) -> tuple[str, str]:
        digits = str(number).zfill(self.config.num_digits)
        return digits + ">", "".join(sorted(digits))
