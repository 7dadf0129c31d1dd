"""The actor loop: ask the dispatcher for work, generate G completions per prompt, score, send.

    client = DispatcherClient(endpoint, "actor-0", capacity, ctx=ctx).start()
    actor = Actor("actor-0", engine, task, client, weights, group_size=8, prompts_per_call=16, seed=0)
    actor.run(stop_event)
    # each round: client.request -> weights.ensure(grant.version) -> engine.sync_weights
    #             -> generate_rollouts (engine.generate, or multi-turn episodes: actors/episodes.py)
    #             -> score_rollouts (the task's reward, inline / worker pool / HTTP: actors/rewards/)
    #             -> client.send_groups
    # or, when the learner evaluates on its actors, an EvalGrant: weights of exactly its version,
    # greedy completions of those held-out prompts, scored -> client.send_eval (evaluate())

The same loop runs as a thread in the learner's process (over `inproc://`, weights by reference)
and in actor processes on any host (over `tcp://`, weights fetched as bytes): the dispatcher
(protocols/dispatch.py) decides what to generate and when, so an actor holds no prompt state and a
dead one costs only the prompts it held, which the dispatcher re-issues.

Every group carries the policy version whose weights produced it and the grant it answers. The
engine is an Engine (actors/engine_api.py): its ``sync_weights(params, version, min_version=)`` is
called before each generation (a no-op for the built-in engine, which samples from the params it is
given); one that holds weights of its own (SGLang) reports per-row ``policy_versions``, and the group
carries the oldest. An actor process warms such an engine up (its servers start on the newest
weights before it asks for work), and its servers' versions are forgotten when the learner restarts
(the resumed run may be older than what they serve).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax

from cadence.actors.engine_api import Engine, GenerationAborted
from cadence.actors.env_runner import EnvRunner
from cadence.actors.episodes import build_groups, generate_rollouts
from cadence.actors.evaluation import heldout_scores
from cadence.actors.rewards import InlineScorer, Scorer, score_rollouts
from cadence.actors.tasks.base import Prompt, Task
from cadence.protocols.messages import EngineTimings, EvalGrant, EvalResult, Grant, RolloutGroup
from cadence.protocols.transport import TransportClosed


@dataclasses.dataclass
class ActorStats:
    """Counters of one actor (written by its worker thread only)."""

    groups: int = 0
    samples: int = 0
    tokens: int = 0
    generate_seconds: float = 0.0  # time inside engine calls
    wait_seconds: float = 0.0  # time waiting for a grant (the staleness bound, or backpressure)
    calls: int = 0


class Actor:
    """Args:
      actor_id: unique among live actors.
      engine: an Engine (actors/engine_api.py: JaxEngine, SGLangEngine).
      task: builds prompt i (`prompt(i)`) and scores completions.
      client: a DispatcherClient (or None for `step` alone, e.g. benchmarks).
      weights: `latest() -> (params, version)` and `ensure(version)` (in-process or fetched).
      seed: sampling seed; every actor of a run uses the same one, since keys are folded with the
        prompt index: a re-issued prompt is sampled the same on whichever actor gets it.
      scorer: where rewards run (actors/rewards/: inline, a worker pool, an HTTP server).
      envs: where a multi-turn task's environments step (actors/env_runner.py: concurrently, with
        a time limit; EnvRunner.from_config(task_cfg)); None: the defaults.
    """

    def __init__(self, actor_id: str, engine: Engine, task: Task, client: Any, weights: Any, group_size: int,
                 prompts_per_call: int, seed: int, scorer: Scorer | None = None, envs: EnvRunner | None = None):
        self.actor_id = actor_id
        self.engine = engine
        self.task = task
        self.client = client
        self.weights = weights
        self.group_size = group_size
        self.prompts_per_call = prompts_per_call
        self.rng = jax.random.key(seed)
        self.stats = ActorStats()
        self.error: BaseException | None = None
        self.scorer = scorer if scorer is not None else InlineScorer(task)
        self.envs = envs
        self._heldout: list[Prompt] | None = None  # task.heldout(), built at the first evaluation

    def set_concurrency(self, prompts_per_call: int) -> None:
        self.prompts_per_call = max(1, int(prompts_per_call))

    def _phase(self, name: str) -> None:
        if self.client is not None:
            self.client.phase(name)

    def _scoring_progress(self, done: int, total: int) -> None:
        # A new phase name per step of progress: the dispatcher's liveness clock restarts, so
        # slow rewards that keep moving are never taken for a hung actor.
        self._phase(f"scoring {done}/{total}")

    def prompts_for(self, grant: Grant) -> list[Prompt]:
        prompts = [self.task.prompt(i) for i in grant.prompt_indices]
        for p, want in zip(prompts, grant.prompt_ids):
            if p.prompt_id != want:
                raise ValueError(f"{self.actor_id}: stream index {p.index} is {p.prompt_id} here but {want} on "
                                 "the learner: the actor's task config or data differ from the learner's")
        return prompts

    def step(self, prompts: list[Prompt], grant: Grant | None = None) -> list[RolloutGroup]:
        """Generate and score one engine call's worth of groups (for `grant`, if given)."""
        G = self.group_size
        params, version = self.weights.latest()  # >= the granted version: only fresher
        # An engine holding its own weights (servers) brings them within the bound; the oldest
        # version the learner will still accept for these samples:
        oldest = version if grant is None else grant.min_version
        self.engine.sync_weights(params, version, min_version=min(oldest, version))
        self._phase("generating")
        queued_at = time.time()
        # The key is a function of the prompts, not of how many calls came before, so a prompt
        # re-issued after a resume is sampled exactly as it would have been.
        key = jax.random.fold_in(self.rng, prompts[0].index)
        rows = [p for p in prompts for _ in range(G)]
        started_at = time.time()
        # ---- generation: one engine call, or multi-turn episodes (actors/episodes.py) ----
        out = generate_rollouts(self.engine, params, self.task, rows, key, envs=self.envs)
        finished_at = time.time()
        seconds = finished_at - started_at
        # ---- scoring: one call per engine result (actors/rewards/); episodes bring their own ----
        self._phase("scoring")
        scores = score_rollouts(self.scorer, self.task, prompts, out, progress=self._scoring_progress)
        groups = build_groups(self.task.name, self.actor_id, prompts, out, scores, version,
                              EngineTimings(queued_at=queued_at, started_at=started_at, finished_at=finished_at,
                                            generate_seconds=seconds, num_tokens=out.generated_tokens,
                                            engine=self.engine.name),
                              grant_id="" if grant is None else grant.grant_id)
        self.stats.calls += 1
        self.stats.generate_seconds += seconds
        self.stats.tokens += out.generated_tokens
        return groups

    def evaluate(self, grant: EvalGrant) -> EvalResult:
        """Greedy completions of the granted held-out prompts with weights of exactly the granted
        version, scored as the learner's own evaluation scores them (actors/evaluation.py)."""
        if self._heldout is None:
            self._heldout = list(self.task.heldout())
        heldout = self._heldout
        prompts = []
        for i, want in zip(grant.prompt_indices, grant.prompt_ids):
            if i >= len(heldout) or heldout[i].prompt_id != want:
                have = heldout[i].prompt_id if i < len(heldout) else f"beyond its {len(heldout)} held-out prompts"
                raise ValueError(f"{self.actor_id}: held-out prompt {i} is {have} here but {want} on the learner: "
                                 "the actor's task config or data differ from the learner's")
            prompts.append(heldout[i])
        self._phase("weights")
        self.weights.ensure(grant.version)
        params, version = self.weights.latest()
        # The learner waits for the evaluation, so the version granted is its newest: an engine
        # holding weights of its own (SGLang) is brought to exactly it.
        self.engine.sync_weights(params, version, min_version=grant.version)
        self._phase("evaluating")
        t0 = time.perf_counter()
        scores, out = heldout_scores(self.engine, self.task, params, prompts, self.scorer, self.envs)
        seconds = time.perf_counter() - t0
        names = sorted({k for s in scores for k in s.metrics})
        return EvalResult(eval_id=grant.eval_id, actor_id=self.actor_id, version=version,
                          prompt_indices=list(grant.prompt_indices), rewards=[float(s.reward) for s in scores],
                          exact_match=[None if s.exact_match is None else bool(s.exact_match) for s in scores],
                          reward_errors=[s.error for s in scores],
                          task_metrics={k: [float(s.metrics.get(k, 0.0)) for s in scores] for k in names},
                          generate_seconds=seconds, num_tokens=out.generated_tokens)

    def warm_up(self) -> None:
        """An engine with weights of its own (SGLang) takes the newest weights before the first
        request for work, so no granted prompt waits while its servers start."""
        if not self.engine.holds_weights:
            return
        self._phase("weights")
        self.weights.ensure(0)  # the newest the learner has
        params, version = self.weights.latest()
        self.engine.sync_weights(params, version)

    def run(self, stop: threading.Event, warm_up: bool = False) -> None:
        """Work until `stop` is set or the learner says stop. An exception is kept in `error`, told
        to the dispatcher (Goodbye with the error) and re-raised. warm_up: call warm_up() first."""
        client = self.client
        session = ""
        try:
            if warm_up:
                self.warm_up()
            while not (stop.is_set() or client.stop_reason):
                if client.concurrency is not None:
                    self.set_concurrency(client.concurrency)
                t0 = time.perf_counter()
                grant = client.request(self.prompts_per_call, stop)
                self.stats.wait_seconds += time.perf_counter() - t0
                if grant is None:
                    continue
                if grant.session != session:  # a new learner session
                    restarted = bool(session)
                    session = grant.session
                    self.weights.reset()  # the resumed run may be older than the weights we hold
                    if restarted:  # so may the weights our servers serve
                        self.engine.forget_weights()
                if isinstance(grant, EvalGrant):  # held-out evaluation, handed out as work
                    result = self.evaluate(grant)
                    client.report(version=result.version)
                    self._phase("sending")
                    client.send_eval(result, grant)
                    continue
                prompts = self.prompts_for(grant)
                self._phase("weights")
                self.weights.ensure(grant.version)
                groups = self.step(prompts, grant)
                client.report(generate_seconds=self.stats.generate_seconds)
                counters = self.engine.counters()
                if counters:  # SGLang's counters, per actor in the learner's metrics
                    client.report(engine_stats={f"{self.engine.name}/{k}": float(v) for k, v in counters.items()})
                if groups:  # the weights version it generates with, for its heartbeats (version lag)
                    client.report(version=max(g.policy_version for g in groups))
                self._phase("sending")
                if client.send_groups(groups, grant):
                    self.stats.groups += len(groups)
                    self.stats.samples += len(groups) * self.group_size
        except BaseException as e:
            if stop.is_set() and _is_abort(e):
                return  # the engine was aborted because the run is stopping: a clean stop
            self.error = e
            client.close(reason=f"{type(e).__name__}: {e}", error=True)
            raise


def _is_abort(e: BaseException) -> bool:
    """A stop cut the engine call (abort()) or the dispatcher's transport short: not a failure."""
    return isinstance(e, (GenerationAborted, TransportClosed))
