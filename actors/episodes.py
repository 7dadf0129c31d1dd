"""Generation for one actor step: a single engine call, or multi-turn episodes with an environment.

    rollouts = generate_rollouts(engine, params, task, rows, key)   # rows: [N] prompts (G per prompt)

Single-turn: one ``engine.generate`` call; the completion is what the engine sampled (up to the
first stop string, when the task has any).

Multi-turn (the task has ``environment(prompt)``, actors/tasks/base.py): every row is an episode.
Each turn, the rows still running are sent to the engine together, each with its whole context so
far (prompt, the model's earlier turns, the observations); the engine re-prefills that context
every turn (no KV cache is kept across turns: simple and engine-agnostic, and for the short
episodes this is meant for the prefill is cheap next to decoding). The model's turn goes to the
environment, whose Step gives observation tokens to append, a reward and whether the episode is
done. An episode ends when the environment says done, after ``task.max_turns`` turns, or when the
tokens after the prompt reach ``task.max_completion_len`` (the last turn is cut there).

Environments are user code and run guarded (actors/env_runner.py): the environments of one turn
step concurrently, one call per live row, each within the runner's time limit
(task.env_timeout_s); one that runs past it ends its episode with reward 0 and the reason
``env_timeout`` (counted as reward/errors/env_timeout), one that raises with ``env_error``; the
other rows go on. Starting an environment (``task.environment(prompt)``) is guarded the same way.

Stop strings: a task may set ``stop`` (strings, e.g. ("</tool_call>",)). A turn then ends at the
first of them as it does at EOS, the string's tokens kept as the turn's last: the engine ends the
row in its loop when the ids match a string's tokenization (JaxEngine; SGLang for one-token
strings), and every row is also cut after the shortest prefix whose text holds a stop string
(another tokenization of the string, or an engine that cannot match it). Cutting is exact for
the learner: a token's sampling probability depends only on what came before it.

What the learner gets per episode: completion = every token after the prompt, in order (model
turns and observations); policy_mask = True on the model's tokens only, so observations are in
the context but out of the loss; behavior logprobs = the engine's for model tokens, 0 for
observations. The learner scores the same sequence in one forward pass, so its logprob of token
t (from logits[t - 1], the whole context before t) is the one the sampler had: the engine saw
exactly these ids as its prompt (they are never re-tokenized from text).
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from cadence.actors.env_runner import EnvRunner, Outcome
from cadence.actors.rewards.scoring import ENV_ERROR, make_completion
from cadence.actors.tasks.base import Prompt, Score, Step, completion_text, is_multi_turn
from cadence.protocols.messages import EngineTimings, RolloutGroup

ENV_TIMEOUT = "env_timeout"  # an environment call ran past task.env_timeout_s (the episode ends there)
_DEFAULT_RUNNER: EnvRunner | None = None
_DEFAULT_LOCK = threading.Lock()


def default_env_runner() -> EnvRunner:
    """The runner for callers that bring none (held-out evaluation, tools): the config's defaults."""
    global _DEFAULT_RUNNER
    with _DEFAULT_LOCK:
        if _DEFAULT_RUNNER is None:
            _DEFAULT_RUNNER = EnvRunner()
        return _DEFAULT_RUNNER


def stop_strings(task) -> tuple[str, ...]:
    """The task's stop strings (its optional ``stop`` attribute), checked."""
    stop = getattr(task, "stop", ()) or ()
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise TypeError(f"task {getattr(task, 'name', '?')!r}: stop must be a sequence of non-empty strings, "
                        f"got {stop!r}")
    return tuple(stop)


def _engine_stop(task, texts: tuple[str, ...]) -> dict:
    """generate() keyword for the stop strings (none when the task has none: any engine works)."""
    return {"stop": [task.tokenizer.encode(t) for t in texts]} if texts else {}


def _text(tokenizer, ids) -> str:
    """The ids up to the first EOS, special tokens shown (a stop string may be one)."""
    return completion_text(tokenizer, ids, skip_special_tokens=False)


def stop_length(tokenizer, ids, texts: tuple[str, ...]) -> int:
    """Length of the shortest prefix of ids whose text holds a stop string; len(ids) if none does."""
    n = len(ids)
    if not texts or not any(t in _text(tokenizer, ids) for t in texts):
        return n
    lo, hi = 1, n  # the text of a longer prefix holds whatever a shorter one's does
    while lo < hi:
        mid = (lo + hi) // 2
        if any(t in _text(tokenizer, ids[:mid]) for t in texts):
            hi = mid
        else:
            lo = mid + 1
    return lo


class Rollouts(NamedTuple):
    """One actor step's generated rows (N = prompts x G): Python lists, or NumPy rows where noted."""

    tokens: list[list[int]]  # [N][T_r] completion ids (multi-turn: every turn and observation)
    logprobs: list  # [N][T_r] behavior logprobs (lists, or 1-D arrays when single-turn); 0.0 on observations
    policy_mask: list[list[bool]] | None  # [N][T_r] True on model tokens; None when single-turn
    versions: np.ndarray | None  # [N] policy version per row (server engines); None: the params' version
    generated_tokens: int  # tokens the engine sampled (all turns)
    scores: list[Score] | None  # [N] multi-turn: the environment's reward and metrics; None: ask the task
    turns: list[int] | None = None  # [N] model turns per episode (multi-turn)
    # [N][T_r] log of the top-p mass kept at each token (0 on observations); None: no truncation
    kept_logmass: list | None = None  # rows as lists, or 1-D arrays when single-turn


def generate_rollouts(engine, params, task, rows: Sequence[Prompt], key: jax.Array,
                      greedy: bool = False, envs: EnvRunner | None = None) -> Rollouts:
    """Single engine call, or episodes when the task is multi-turn (see the module docstring).
    envs: where environment calls run (default: default_env_runner())."""
    if is_multi_turn(task):
        return run_episodes(engine, params, task, rows, key, greedy, envs)
    texts = stop_strings(task)
    result = engine.generate(params, [list(p.tokens) for p in rows], key, greedy=greedy, **_engine_stop(task, texts))
    tokens, logprobs = [], []
    for r in range(len(rows)):
        n = int(result.lengths[r])
        ids = result.tokens[r, :n].tolist()  # the scorer reads ids as a list
        n = stop_length(task.tokenizer, ids, texts)
        tokens.append(ids[:n])
        logprobs.append(result.logprobs[r, :n])  # rows of the engine's array: packed as they are
    versions = result.policy_versions
    kept = _kept(result)
    return Rollouts(tokens, logprobs, None, None if versions is None else np.asarray(versions),
                    sum(len(t) for t in tokens), None,
                    kept_logmass=None if kept is None else [kept[r, :len(t)] for r, t in enumerate(tokens)])


def _kept(result) -> np.ndarray | None:
    """The engine's [N, M] kept top-p log-mass, or None when it cut nothing (or does not say)."""
    kept = result.kept_logmass
    return kept if kept is not None and np.any(kept != 0) else None


class _Episode:
    def __init__(self, prompt: Prompt, env: Any):
        self.prompt, self.env = prompt, env
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.kept: list[float] = []  # top-p kept log-mass per token (0 on observations)
        self.mask: list[bool] = []
        self.reward = 0.0
        self.metrics: dict[str, float] = {}
        self.error = ""
        self.turns = 0
        self.done = False
        self.version: int | None = None


def run_episodes(engine, params, task, rows: Sequence[Prompt], key: jax.Array,
                 greedy: bool = False, envs: EnvRunner | None = None) -> Rollouts:
    """Runs one episode per row to its end; see the module docstring."""
    envs = envs or default_env_runner()
    budget = int(task.max_completion_len)
    max_turns = int(getattr(task, "max_turns", 1))
    texts = stop_strings(task)
    stop = _engine_stop(task, texts)
    episodes = []
    for p, started in zip(rows, envs.map([functools.partial(task.environment, p) for p in rows])):
        ep = _Episode(p, started.value)
        if started.error is not None or started.timed_out:  # a broken environment ends only its own episode
            ep.done, ep.error = True, ENV_TIMEOUT if started.timed_out else ENV_ERROR
        episodes.append(ep)
    generated, truncated = 0, False
    for turn in range(max_turns):
        live = [ep for ep in episodes if not ep.done]
        if not live:
            break
        context = [list(ep.prompt.tokens) + ep.tokens for ep in live]
        result = engine.generate(params, context, jax.random.fold_in(key, turn), greedy=greedy, **stop)
        versions = result.policy_versions
        kept = _kept(result)
        truncated = truncated or kept is not None
        turns = []
        for r, ep in enumerate(live):
            n = min(int(result.lengths[r]), budget - len(ep.tokens))
            ids = result.tokens[r, :n].tolist()
            n = stop_length(task.tokenizer, ids, texts)
            ids = ids[:n]
            generated += n
            ep.tokens += ids
            ep.logprobs += result.logprobs[r, :n].astype(np.float64).tolist()
            ep.kept += [0.0] * n if kept is None else kept[r, :n].astype(np.float64).tolist()
            ep.mask += [True] * n
            ep.turns += 1
            if versions is not None:
                v = int(versions[r])
                ep.version = v if ep.version is None else min(ep.version, v)
            turns.append(make_completion(task.tokenizer, ids))
        # every live row's environment at once, each within the time limit
        steps = envs.map([functools.partial(ep.env.step, t) for ep, t in zip(live, turns)])
        for ep, step in zip(live, steps):
            _apply_step(ep, step, budget, last_turn=turn == max_turns - 1)
    return Rollouts([ep.tokens for ep in episodes], [ep.logprobs for ep in episodes],
                    [ep.mask for ep in episodes],
                    None if episodes[0].version is None else np.asarray([ep.version or 0 for ep in episodes]),
                    generated,
                    [Score(0.0 if ep.error else ep.reward, None, ep.metrics, ep.error) for ep in episodes],
                    [ep.turns for ep in episodes],
                    kept_logmass=[ep.kept for ep in episodes] if truncated else None)


def _apply_step(ep: _Episode, outcome: Outcome, budget: int, last_turn: bool) -> None:
    """The environment's answer to one model turn (or its failure), applied to the episode."""
    if outcome.timed_out:
        ep.done, ep.error = True, ENV_TIMEOUT
        return
    if outcome.error is not None:  # it raised (whatever it raised: user code)
        ep.done, ep.error = True, ENV_ERROR
        return
    try:
        step = outcome.value
        if not isinstance(step, Step):
            raise TypeError(f"environment.step must return a Step, got {type(step).__name__}")
        reward = float(step.reward)
        if not np.isfinite(reward):
            raise ValueError("non-finite reward")
        observation = [int(t) for t in step.observation]
        metrics = {k: float(v) for k, v in dict(step.metrics).items()}
    except Exception:  # noqa: BLE001 - the episode ends, scored 0 and counted
        ep.done, ep.error = True, ENV_ERROR
        return
    ep.reward += reward
    for k, v in metrics.items():
        ep.metrics[k] = ep.metrics.get(k, 0.0) + v
    room = budget - len(ep.tokens)
    if step.done or last_turn or room <= len(observation):
        ep.done = True  # an observation the model would never answer is not kept
        return
    ep.tokens += observation
    ep.logprobs += [0.0] * len(observation)
    ep.kept += [0.0] * len(observation)
    ep.mask += [False] * len(observation)


def build_groups(task_name: str, actor_id: str, prompts: Sequence[Prompt], out: Rollouts,
                 scores: Sequence[Sequence[Score]], version: int, call: EngineTimings,
                 grant_id: str = "") -> list[RolloutGroup]:
    """One RolloutGroup per prompt from an actor step's rollouts (G = rows per prompt) and scores.

    call: the whole engine call's timings; each group gets its share of generate_seconds by tokens.
    grant_id: the dispatcher's grant the groups answer.
    """
    G = len(out.tokens) // len(prompts)
    groups = []
    for i, prompt in enumerate(prompts):
        rows = range(i * G, (i + 1) * G)
        completions = [out.tokens[r] for r in rows]
        group_scores = scores[i]
        exact = [s.exact_match for s in group_scores]
        names = sorted({k for s in group_scores for k in s.metrics})
        tokens = sum(len(c) for c in completions)
        groups.append(RolloutGroup(
            prompt_id=prompt.prompt_id, task=task_name, prompt_tokens=list(prompt.tokens),
            completion_tokens=completions, behavior_logprobs=[out.logprobs[r] for r in rows],
            rewards=[s.reward for s in group_scores],
            exact_match=None if any(e is None for e in exact) else exact,
            policy_mask=None if out.policy_mask is None else [out.policy_mask[r] for r in rows],
            kept_logmass=None if out.kept_logmass is None else [out.kept_logmass[r] for r in rows],
            reward_errors=[s.error for s in group_scores] if any(s.error for s in group_scores) else None,
            task_metrics={k: [float(s.metrics.get(k, 0.0)) for s in group_scores] for k in names} or None,
            actor_id=actor_id,
            # Server engines report each row's version; a group is as old as its oldest row.
            policy_version=version if out.versions is None else int(min(out.versions[i * G:(i + 1) * G])),
            timings=EngineTimings(queued_at=call.queued_at, started_at=call.started_at,
                                  finished_at=call.finished_at,
                                  generate_seconds=call.generate_seconds * tokens / max(out.generated_tokens, 1),
                                  num_tokens=tokens, engine=call.engine),
            grant_id=grant_id))
    return groups
