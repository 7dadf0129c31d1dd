"""The actor loop: admit prompts, generate G completions each, score them, send one group each.

    actor = Actor(...)
    thread = threading.Thread(target=actor.run, args=(stop_event,))
    # each round: gate.admit -> weights.latest -> [engine.sync_weights]
    #             -> generate_rollouts (engine.generate, or multi-turn episodes: actors/episodes.py)
    #             -> score_groups (the task's reward, inline / worker pool / HTTP: actors/rewards/)
    #             -> transport.put

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

from actors.episodes import build_groups, generate_rollouts
from actors.prompt_stream import PromptStream
from actors.rewards import InlineScorer, Scorer, score_rollouts
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
                 prompts_per_call: int, seed: int, ledger: SampleLedger | None = None,
                 scorer: Scorer | None = None):
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
        self.scorer = scorer if scorer is not None else InlineScorer(task)  # where rewards run

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
        rows = [p for p in prompts for _ in range(G)]
        started_at = time.time()
        # ---- generation: one engine call, or multi-turn episodes (actors/episodes.py) ----
        out = generate_rollouts(self.engine, params, self.task, rows, key)
        finished_at = time.time()
        seconds = finished_at - started_at
        # ---- scoring: one call per engine result (actors/rewards/); episodes bring their own ----
        scores = score_rollouts(self.scorer, self.task, prompts, out)
        groups = build_groups(self.task.name, self.actor_id, prompts, out, scores, version,
                              EngineTimings(queued_at=queued_at, started_at=started_at, finished_at=finished_at,
                                            generate_seconds=seconds, num_tokens=out.generated_tokens,
                                            engine=getattr(self.engine, "name", "jax")))
        self.stats.calls += 1
        self.stats.generate_seconds += seconds
        self.stats.tokens += out.generated_tokens
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
