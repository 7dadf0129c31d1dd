"""The actor loop: admit prompts, generate G completions each, score them, send one group each.

    actor = Actor(...)
    thread = threading.Thread(target=actor.run, args=(stop_event,))
    # each round: gate.admit -> weights.latest -> [engine.sync_weights] -> engine.generate
    #             -> task.reward -> transport.put

Every group carries the policy version whose weights produced it. An engine that serves weights
of its own (SGLang) has a ``sync_weights(params, version, min_version=)`` hook, called before each
generation, and reports per-row ``policy_versions``: the group carries the oldest. An actor starts a group only
when the admission gate says it will not be too stale by the time the learner consumes it.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax
import numpy as np

from actors.prompt_stream import PromptStream
from actors.tasks.base import Prompt, Task
from protocols.admission import AdmissionGate
from protocols.ledger import SampleLedger
from protocols.messages import EngineTimings, RolloutGroup
from protocols.transport import TransportClosed


@dataclasses.dataclass
class ActorStats:
    """Counters read by the progress display (written by one actor thread only)."""

    groups: int = 0
    samples: int = 0
    tokens: int = 0
    generate_seconds: float = 0.0  # time inside engine calls
    admission_wait_seconds: float = 0.0  # time blocked by the staleness bound
    calls: int = 0


class Actor:
    def __init__(self, actor_id: str, engine: Any, task: Task, stream: PromptStream,
                 gate: AdmissionGate, weights: Any, transport: Any, group_size: int,
                 prompts_per_call: int, seed: int, ledger: SampleLedger | None = None):
        self.actor_id = actor_id
        self.engine = engine
        self.task = task
        self.stream = stream
        self.gate = gate
        self.weights = weights
        self.transport = transport
        self.group_size = group_size
        self.prompts_per_call = prompts_per_call
        self.rng = jax.random.key(seed)
        self.ledger = ledger or SampleLedger()
        self.stats = ActorStats()
        self.error: BaseException | None = None

    def set_concurrency(self, prompts_per_call: int) -> None:
        self.prompts_per_call = max(1, int(prompts_per_call))

    def _admit(self, stop: threading.Event) -> int:
        """Block for one group's credits, then take up to prompts_per_call groups without waiting."""
        G = self.group_size
        t0 = time.perf_counter()
        while not stop.is_set():
            version = self.gate.admit(G, lambda: self.weights.version, timeout=0.1)
            if version is not None:
                break
        else:
            return 0
        n = 1
        while n < self.prompts_per_call and self.gate.try_admit(G, version):
            n += 1
        self.stats.admission_wait_seconds += time.perf_counter() - t0
        return n

    def step(self, prompts: list[Prompt]) -> list[RolloutGroup]:
        """Generate and score one engine call's worth of groups."""
        G = self.group_size
        params, version = self.weights.latest()  # >= the admitted version: only fresher
        sync = getattr(self.engine, "sync_weights", None)
        if sync is not None:  # a server engine holds its own weights: bring them within the bound
            # The oldest version the learner will still accept for the last sample admitted so far.
            oldest = self.gate.consuming_step(0) - self.gate.max_staleness
            sync(params, version, min_version=min(oldest, version))
        queued_at = time.time()
        # The key is a function of the prompts, not of how many calls came before, so a prompt
        # re-issued after a resume is sampled exactly as it would have been.
        key = jax.random.fold_in(self.rng, prompts[0].index)
        rows = [list(p.tokens) for p in prompts for _ in range(G)]
        started_at = time.time()
        result = self.engine.generate(params, rows, key)
        finished_at = time.time()
        seconds = finished_at - started_at
        # Server engines report the version each row actually came from; a group is as old as its
        # oldest row.
        row_versions = getattr(result, "policy_versions", None)
        engine_name = getattr(self.engine, "name", "jax")
        kept = getattr(result, "kept_logmass", None)  # top-p truncation; not sent when there is none
        kept = kept if kept is not None and np.any(kept != 0) else None
        groups = []
        for i, prompt in enumerate(prompts):
            completions, logprobs, rewards, exact = [], [], [], []
            for r in range(i * G, (i + 1) * G):
                n = int(result.lengths[r])
                ids = result.tokens[r, :n].tolist()
                completions.append(ids)
                logprobs.append(result.logprobs[r, :n].astype(np.float64).tolist())
                rewards.append(float(self.task.reward(prompt, ids)))
                exact.append(bool(self.task.exact_match(prompt, ids)))
            tokens = sum(len(c) for c in completions)
            groups.append(RolloutGroup(
                prompt_id=prompt.prompt_id, task=self.task.name, prompt_tokens=list(prompt.tokens),
                completion_tokens=completions, behavior_logprobs=logprobs, rewards=rewards,
                exact_match=exact, actor_id=self.actor_id,
                kept_logmass=None if kept is None else [
                    kept[r, :len(completions[r - i * G])].astype(np.float64).tolist()
                    for r in range(i * G, (i + 1) * G)],
                policy_version=version if row_versions is None else int(min(row_versions[i * G:(i + 1) * G])),
                timings=EngineTimings(queued_at=queued_at, started_at=started_at,
                                      finished_at=finished_at,
                                      generate_seconds=seconds * tokens / max(int(result.lengths.sum()), 1),
                                      num_tokens=tokens, engine=engine_name)))
        self.stats.calls += 1
        self.stats.generate_seconds += seconds
        self.stats.tokens += int(result.lengths.sum())
        return groups

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                n = self._admit(stop)
                if n == 0:
                    return
                if stop.is_set():
                    self.gate.cancel(n * self.group_size)
                    return
                with self.ledger.lock:  # a checkpoint snapshot sees stream and ledger agree
                    prompts = self.stream.take(n)
                    self.ledger.issue(prompts)
                groups = self.step(prompts)
                for g in groups:
                    self.ledger.queue(g)
                    self.transport.put(g)
                self.stats.groups += len(groups)
                self.stats.samples += len(groups) * self.group_size
        except TransportClosed:
            return  # the learner shut the pipeline down: a clean stop
        except BaseException as e:  # surfaced by the learner loop, which owns the process
            self.error = e
            stop.set()
            raise
