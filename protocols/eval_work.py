"""Held-out evaluation as work for the actors: the dispatcher's bookkeeping of one evaluation.

    work = EvalWork(session)
    work.start(version, indices, prompt_ids, parts=3, on_done=lambda job: ...)   # chunks pending
    grant = work.take("proc-0")          # an idle actor's next work: an EvalGrant, or None
    work.answer("proc-0", result)        # an EvalResult: accepted, late, or bad (why)
    work.release("proc-0")               # the actor is gone: its chunk goes back, first in line

The held-out set is split into `parts` chunks (at least one per live actor); each actor holds at
most one chunk at a time, and a chunk whose actor dies, hangs or leaves is handed to the next
idle actor, as the dispatcher re-issues training prompts. Each chunk has its own id, so an answer
from an actor declared gone (or from an earlier evaluation) is recognised as late and dropped.
When every prompt has its score, `on_done(job)` runs (on the dispatcher's thread); also when
actors holding its chunks failed MAX_FAILURES times (a reward or held-out set that breaks on every
actor would otherwise be retried forever while the learner waits): `job.failed` then says why.

Pure bookkeeping like protocols/dispatch.py: no sockets, no threads, no clock.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Callable

from cadence.protocols.messages import EvalGrant, EvalResult

MAX_FAILURES = 3  # actors that failed holding a chunk of one evaluation before it fails


@dataclasses.dataclass(frozen=True)
class PromptScore:
    """One held-out prompt's score as an actor reported it (actors/evaluation.py aggregates)."""

    reward: float
    exact_match: bool | None
    metrics: dict[str, float]
    error: str


@dataclasses.dataclass
class EvalJob:
    """One evaluation: the version, the held-out prompts, and the scores collected so far."""

    eval_id: str
    version: int
    indices: list[int]
    prompt_ids: list[str]
    on_done: Callable[["EvalJob"], None]
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)  # chunks: lists of positions
    held: dict[str, tuple[str, list[int]]] = dataclasses.field(default_factory=dict)  # actor -> (chunk id, positions)
    scores: dict[int, PromptScore] = dataclasses.field(default_factory=dict)  # position -> score
    reissued: int = 0  # chunks handed out again after their actor was gone
    generate_seconds: float = 0.0  # the actors' engine time, summed over chunks
    num_tokens: int = 0
    done: bool = False
    failures: list[str] = dataclasses.field(default_factory=list)  # why actors holding a chunk failed
    failed: str = ""  # set when the evaluation gave up (MAX_FAILURES)

    def ordered(self) -> list[PromptScore]:
        """The scores in the held-out order the job was started with."""
        return [self.scores[i] for i in range(len(self.indices))]


class EvalWork:
    """The dispatcher's one evaluation in progress (module docstring)."""

    def __init__(self, session: str):
        self.session = session
        self.job: EvalJob | None = None
        self._ids = itertools.count()
        self._chunk_ids = itertools.count()
        self.late = 0  # answers to no chunk held (a gone actor's, an earlier evaluation's)
        self.reissued = 0  # chunks handed out again, over the run

    def start(self, version: int, indices: list[int], prompt_ids: list[str], parts: int,
              on_done: Callable[[EvalJob], None]) -> EvalJob:
        """A new evaluation of `version` (one at a time: an unfinished one is dropped)."""
        if len(indices) != len(prompt_ids) or not indices:
            raise ValueError(f"an evaluation needs prompts, and an id for each ({len(indices)} indices, "
                             f"{len(prompt_ids)} ids)")
        job = EvalJob(f"{self.session}-e{next(self._ids)}", version, list(indices), list(prompt_ids), on_done)
        size = math.ceil(len(indices) / max(1, parts))
        positions = list(range(len(indices)))
        job.pending.extend(positions[i:i + size] for i in range(0, len(positions), size))
        self.job = job
        return job

    @property
    def active(self) -> bool:
        return self.job is not None and not self.job.done

    def holds(self, actor_id: str) -> bool:
        return self.active and actor_id in self.job.held

    def take(self, actor_id: str) -> EvalGrant | None:
        """The next chunk for an actor that asks for work, if one is waiting and it holds none."""
        job = self.job
        if not self.active or not job.pending or actor_id in job.held:
            return None
        chunk = job.pending.popleft()
        chunk_id = f"{job.eval_id}-{next(self._chunk_ids)}"
        job.held[actor_id] = (chunk_id, chunk)
        return EvalGrant(eval_id=chunk_id, prompt_indices=[job.indices[i] for i in chunk],
                         prompt_ids=[job.prompt_ids[i] for i in chunk], version=job.version, session=self.session)

    def answer(self, actor_id: str, result: EvalResult) -> str:
        """Take an actor's EvalResult: "" if accepted (or late: counted and dropped), else why it is
        not what was granted (the dispatcher cuts such an actor off; its chunk is released)."""
        job = self.job
        held = job.held.get(actor_id) if self.active else None
        if held is None or held[0] != result.eval_id:
            self.late += 1
            return ""
        _, chunk = held
        want = [job.indices[i] for i in chunk]
        if list(result.prompt_indices) != want:
            return f"answers prompts {list(result.prompt_indices)[:4]}... for the granted {want[:4]}..."
        if result.version != job.version:
            return f"evaluated version {result.version}, not the granted {job.version}"
        del job.held[actor_id]
        for k, i in enumerate(chunk):
            job.scores[i] = PromptScore(result.rewards[k], result.exact_match[k],
                                        {name: values[k] for name, values in result.task_metrics.items()},
                                        result.reward_errors[k])
        job.generate_seconds += result.generate_seconds
        job.num_tokens += result.num_tokens
        if len(job.scores) == len(job.indices):
            job.done = True
            job.on_done(job)
        return ""

    def release(self, actor_id: str, error: str = "") -> bool:
        """The actor is gone: the chunk it held (if any) goes back, first in line. True if it held one.
        error: why, if it failed (MAX_FAILURES of them end the evaluation)."""
        if not self.active:
            return False
        job = self.job
        held = job.held.pop(actor_id, None)
        if held is None:
            return False
        job.pending.appendleft(held[1])
        job.reissued += 1
        self.reissued += 1
        if error:
            job.failures.append(f"{actor_id}: {error}")
            if len(job.failures) >= MAX_FAILURES:
                job.failed = (f"{len(job.failures)} actors failed evaluating version {job.version}; "
                              f"the last: {job.failures[-1]}")
                job.done = True
                job.on_done(job)
        return True

    def cancel(self) -> None:
        """Drop the evaluation in progress (its waiter gave up): answers to it are late from now."""
        if self.job is not None:
            self.job.done = True
