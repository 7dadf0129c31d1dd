"""A task's training stream, handed out in order to any number of actor threads.

Prompt i is a pure function of (task seed, i), so the stream is fully described by its next
index plus the indices to hand out again first (prompts that were in flight when a run stopped):
that is what a checkpoint stores to continue where it stopped.
"""
from __future__ import annotations

import threading

from cadence.actors.tasks.base import Prompt, Task


class PromptStream:
    def __init__(self, task: Task, start: int = 0, reissue: list[int] = ()):
        self.task = task
        self._next = start
        self._reissue = list(reissue)
        self._lock = threading.Lock()

    def take(self, n: int) -> list[Prompt]:
        with self._lock:
            indices = self._reissue[:n]
            del self._reissue[:n]
            fresh = n - len(indices)
            indices += range(self._next, self._next + fresh)
            self._next += fresh
        return [self.task.prompt(i) for i in indices]

    def reissue(self, indices) -> None:
        """Hand these out again, before anything fresh (prompts of an actor that is gone)."""
        with self._lock:
            self._reissue[:0] = sorted(indices)

    @property
    def position(self) -> int:
        """Index of the next fresh prompt to hand out."""
        with self._lock:
            return self._next

    @property
    def pending_reissue(self) -> list[int]:
        with self._lock:
            return list(self._reissue)
