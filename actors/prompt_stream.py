"""A task's training stream, handed out in order to any number of actor threads.

Prompt i is a pure function of (task seed, i), so the stream is fully described by its next
index: that is what a checkpoint stores to continue where it stopped.
"""
from __future__ import annotations

import threading

from actors.tasks.base import Prompt, Task


class PromptStream:
    def __init__(self, task: Task, start: int = 0):
        self.task = task
        self._next = start
        self._lock = threading.Lock()

    def take(self, n: int) -> list[Prompt]:
        with self._lock:
            first, self._next = self._next, self._next + n
        return [self.task.prompt(i) for i in range(first, first + n)]

    @property
    def position(self) -> int:
        """Index of the next prompt to hand out."""
        with self._lock:
            return self._next
