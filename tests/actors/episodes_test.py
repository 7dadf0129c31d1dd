"""Multi-turn episodes: loss masks, behavior/learner logprob alignment across turns, PPO's GAE over
non-contiguous masks, and the episode limits, against NumPy references on hand-made episodes.
"""
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.actors.engine import EngineConfig, JaxEngine
from cadence.actors.env_runner import EnvRunner
from cadence.actors.episodes import ENV_TIMEOUT, build_groups, generate_rollouts, run_episodes
from cadence.actors.tasks.base import Prompt, Step
from cadence.learner.algorithms import ppo as ppo_ops
from cadence.learner.algorithms.logprobs import token_logprobs_and_entropy
from cadence.learner.batching import build_microbatches
from cadence.learner.config import GRPOConfig
from cadence.learner.models.char_tokenizer import CharTokenizer
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.llama import forward, init_params
from cadence.protocols.messages import EngineTimings, RolloutGroup

OBS = (30, 31, 32)  # what the scripted tool answers every turn


class ScriptedEnv:
    """Answers each model turn with OBS; done after `turns` turns, reward 1 per model token."""

    def __init__(self, turns, fail_at=None):
        self.turns, self.fail_at, self.n = turns, fail_at, 0

    def step(self, turn):
        self.n += 1
        if self.n == self.fail_at:
            raise RuntimeError("tool crashed")
        return Step(observation=OBS, reward=float(len(turn.ids)), done=self.n >= self.turns,
                    metrics={"tool_calls": 1.0})


class ScriptedTask:
    name = "scripted"
    max_prompt_len = 4

    def __init__(self, turns=3, budget=40, max_turns=5, fail_at=None):
        self.tokenizer = CharTokenizer()
        self.turns, self.max_completion_len, self.max_turns, self.fail_at = turns, budget, max_turns, fail_at

    def environment(self, prompt):
        return ScriptedEnv(self.turns, self.fail_at)


def group(prompt, completions, logprobs, masks, rewards):
    return RolloutGroup(prompt_id="p/train/0", task="t", prompt_tokens=list(prompt), completion_tokens=completions,
                        behavior_logprobs=logprobs, rewards=rewards, policy_version=0, actor_id="a",
                        policy_mask=masks,
                        timings=EngineTimings(queued_at=0, started_at=0, finished_at=0, generate_seconds=0,
                                              num_tokens=0, engine="jax"))


def test_microbatch_masks_follow_the_policy_mask():
    # Two hand-made episodes: model [5 6] tool [30 31] model [7 2]; and model [8 2] (one turn).
    prompt = [1, 9, 10]
    ep1 = [5, 6, 30, 31, 7, 2]
    m1 = [True, True, False, False, True, True]
    lp1 = [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4]
    ep2, m2, lp2 = [8, 2], [True, True], [-0.5, -0.6]
    g = group(prompt, [ep1, ep2], [lp1, lp2], [m1, m2], [1.0, 0.0])
    mbs, stats = build_microbatches([g], seq_len=16, microbatch_size=2, pad_id=0, grpo_cfg=GRPOConfig())
    mb = mbs[0]
    # NumPy reference, written out position by position
    loss = np.zeros((2, 16), np.float32)
    loss[0, 3:5] = 1, 1
    loss[0, 7:9] = 1, 1
    loss[1, 3:5] = 1
    behavior = np.zeros((2, 16), np.float32)
    behavior[0, [3, 4, 7, 8]] = [-0.1, -0.2, -0.3, -0.4]
    behavior[1, [3, 4]] = [-0.5, -0.6]
    np.testing.assert_array_equal(mb.loss_mask, loss)
    np.testing.assert_allclose(mb.behavior_logprobs, behavior)
    np.testing.assert_array_equal(mb.tokens[0, :9], prompt + ep1)  # observations stay in the context
    np.testing.assert_array_equal(mb.mask[0], np.arange(16) < 9)
    assert stats["num_tokens"] == 6  # the loss normalizer counts model tokens only
    np.testing.assert_allclose(mb.advantages, [1.0, -1.0], atol=1e-4)  # (r - mean) / std, per sample


def test_gae_over_a_non_contiguous_mask_matches_a_numpy_reference():
    rng = np.random.default_rng(0)
    T = 12
    mask = np.zeros((3, T), np.float32)
    mask[0, [3, 4, 7, 8, 9]] = 1  # two turns, tool output at 5-6
    mask[1, 2:6] = 1  # single turn (contiguous)
    mask[2, [4, 10]] = 1  # one token per turn
    values = rng.normal(size=(3, T)).astype(np.float32)
    rewards = np.asarray([1.0, -0.5, 2.0], np.float32)
    gamma, lam = 0.9, 0.8

    def reference(row):
        idx = np.flatnonzero(mask[row])
        r = np.zeros(len(idx))
        r[-1] = rewards[row]
        v = values[row, idx]
        adv = np.zeros(len(idx))
        nxt_a, nxt_v = 0.0, 0.0
        for k in reversed(range(len(idx))):
            adv[k] = r[k] + gamma * nxt_v - v[k] + gamma * lam * nxt_a
            nxt_a, nxt_v = adv[k], v[k]
        out = np.zeros(T)
        out[idx] = adv
        return out

    token_rewards = ppo_ops.token_rewards(jnp.asarray(rewards), jnp.asarray(mask))
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(token_rewards)[0]), [9])  # the LAST model token
    adv, ret = ppo_ops.gae(token_rewards, jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    expected = np.stack([reference(b) for b in range(3)])
    np.testing.assert_allclose(np.asarray(adv), expected, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), (expected + values) * mask, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(max_seq_len=64)
    graphdef, params = init_params(cfg, 0)
    engine = JaxEngine(cfg, graphdef, EngineConfig(max_new_tokens=4), eos_id=2, pad_id=0)
    return cfg, graphdef, params, engine


def test_episode_logprobs_align_with_the_learner_across_turns(model):
    cfg, graphdef, params, engine = model
    task = ScriptedTask(turns=3)
    prompts = [Prompt(f"p/train/{i}", i, (1, 4 + i, 5 + i)) for i in range(3)]
    out = generate_rollouts(engine, params, task, [p for p in prompts for _ in range(2)], jax.random.key(1))
    assert out.policy_mask is not None and out.turns == [3] * 6
    for tokens, mask, lp in zip(out.tokens, out.policy_mask, out.logprobs):
        assert len(tokens) == len(mask) == len(lp)
        # every turn's tool output sits between model turns, exactly OBS, masked out
        obs_runs = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)
                    if not any(mask[i:i + 3]) and (i == 0 or mask[i - 1])]
        assert obs_runs == [OBS, OBS]
        assert all(lp[i] == 0.0 for i in range(len(lp)) if not mask[i])
    # The learner's one forward pass over prompt + episode gives the sampler's logprobs.
    groups = [group(prompts[i].tokens, out.tokens[2 * i:2 * i + 2], out.logprobs[2 * i:2 * i + 2],
                    out.policy_mask[2 * i:2 * i + 2], [0.0, 1.0]) for i in range(3)]
    mbs, stats = build_microbatches(groups, seq_len=48, microbatch_size=6, pad_id=0, grpo_cfg=GRPOConfig())
    mb = mbs[0]
    logits = forward(graphdef, params, jnp.asarray(mb.tokens), jnp.asarray(mb.positions), jnp.asarray(mb.mask))
    learner_lp, _ = token_logprobs_and_entropy(logits, jnp.asarray(mb.tokens))
    m = mb.loss_mask > 0
    assert m.sum() == stats["num_tokens"] == sum(sum(x) for x in out.policy_mask)
    np.testing.assert_allclose(np.asarray(learner_lp)[m], mb.behavior_logprobs[m], atol=2e-5)
    # the environment's reward and metrics are the episode's score
    assert [s.reward for s in out.scores] == [float(sum(mk)) for mk in out.policy_mask]
    assert all(s.metrics == {"tool_calls": 3.0} for s in out.scores)


def test_turn_limit_token_budget_and_a_crashing_environment(model):
    _, _, params, engine = model
    p = [Prompt("p/train/0", 0, (1, 4, 5))]
    # turn limit: the env never says done
    out = run_episodes(engine, params, ScriptedTask(turns=99, max_turns=2), p, jax.random.key(0))
    assert out.turns == [2]
    assert out.tokens[0][-3:] != list(OBS)  # no observation after the last turn
    # token budget: 6 tokens after the prompt at most; the episode stops there
    out = run_episodes(engine, params, ScriptedTask(turns=99, budget=6), p, jax.random.key(0))
    assert len(out.tokens[0]) <= 6
    # a crashing environment ends the episode: reward 0, counted as env_error
    out = run_episodes(engine, params, ScriptedTask(turns=5, fail_at=2), p, jax.random.key(0))
    assert out.turns == [2] and out.scores[0].reward == 0.0 and out.scores[0].error == "env_error"


def test_top_p_kept_mass_follows_the_episode_tokens(model):
    # Multi-turn with top-p: the kept log-mass lines up with every token, 0 on observations.
    cfg, graphdef, params, _ = model
    engine = JaxEngine(cfg, graphdef, EngineConfig(max_new_tokens=4, top_p=0.7), eos_id=2, pad_id=0)
    p = [Prompt(f"p/train/{i}", i, (1, 4 + i, 5 + i)) for i in range(2)]
    out = generate_rollouts(engine, params, ScriptedTask(turns=3), p, jax.random.key(2))
    assert out.kept_logmass is not None
    for tokens, mask, kept in zip(out.tokens, out.policy_mask, out.kept_logmass):
        assert len(kept) == len(tokens)
        assert all(k == 0.0 for k, m in zip(kept, mask) if not m) and all(k <= 0.0 for k in kept)
        assert any(k < 0.0 for k in kept)
    full = JaxEngine(cfg, graphdef, EngineConfig(max_new_tokens=4), eos_id=2, pad_id=0)
    assert generate_rollouts(full, params, ScriptedTask(turns=3), p, jax.random.key(2)).kept_logmass is None


class HangingEnv:
    """Hangs on its `hang_at`-th step (a tool that never answers) until `release` is set."""

    def __init__(self, hang_at, release, barrier=None):
        self.hang_at, self.release, self.barrier, self.n = hang_at, release, barrier, 0

    def step(self, turn):
        self.n += 1
        if self.barrier is not None:
            self.barrier.wait()  # every row's step is running at once, or this breaks
        if self.n == self.hang_at:
            self.release.wait()
        return Step(observation=OBS, reward=1.0, done=self.n >= 2)


class HangingTask(ScriptedTask):
    def __init__(self, hang_rows, barrier=None):
        super().__init__()
        self.hang_rows, self.barrier, self.release = hang_rows, barrier, threading.Event()

    def environment(self, prompt):
        return HangingEnv(1 if prompt.index in self.hang_rows else 0, self.release, self.barrier)


def test_a_hanging_environment_ends_its_episode_at_the_limit_and_is_counted(model):
    _, _, params, engine = model
    task = HangingTask(hang_rows={1})
    rows = [Prompt(f"p/train/{i}", i, (1, 4 + i, 5 + i)) for i in range(3)]
    t0 = time.monotonic()
    try:
        out = run_episodes(engine, params, task, rows, jax.random.key(0), envs=EnvRunner(threads=4, timeout_s=0.5))
    finally:
        task.release.set()
    assert time.monotonic() - t0 < 20  # the hang would hold the actor forever
    assert [s.error for s in out.scores] == ["", ENV_TIMEOUT, ""]
    assert out.scores[1].reward == 0.0 and out.turns == [2, 1, 2] and out.scores[0].reward == 2.0
    # what the learner counts as reward/errors/env_timeout
    call = EngineTimings(queued_at=0, started_at=0, finished_at=0, generate_seconds=0, num_tokens=0, engine="jax")
    groups = build_groups("scripted", "a", rows, out, [[s] for s in out.scores], 0, call)
    assert [g.reward_errors for g in groups] == [None, [ENV_TIMEOUT], None]


def test_rows_step_concurrently(model):
    _, _, params, engine = model
    n = 4  # each step waits for all the rows' steps: stepped one after another, the barrier breaks
    task = HangingTask(hang_rows=set(), barrier=threading.Barrier(n, timeout=10))
    rows = [Prompt(f"p/train/{i}", i, (1, 4 + i, 5 + i)) for i in range(n)]
    out = run_episodes(engine, params, task, rows, jax.random.key(0), envs=EnvRunner(threads=n, timeout_s=30))
    assert [s.error for s in out.scores] == [""] * n and out.turns == [2] * n


class StopTask(ScriptedTask):
    """ScriptedTask with stop strings; its environments record the turns they saw."""

    def __init__(self, stop, **kw):
        super().__init__(**kw)
        self.stop, self.seen = stop, []

    def environment(self, prompt):
        task = self

        class Recording(ScriptedEnv):
            def step(self, turn):
                task.seen.append(turn.text)
                return super().step(turn)

        return Recording(self.turns)


class NoStopEngine:
    """The real engine, asked without the stop sequences (an engine that cannot match them)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, params, rows, key, greedy=False, stop=()):
        return self.engine.generate(params, rows, key, greedy=greedy)


@pytest.mark.parametrize("where", ["engine", "cut"])
def test_a_stop_string_ends_a_turn(where):
    """engine: the JAX engine ends the row in its loop; cut: an engine that ignores the stop
    sequences, and the episode cuts the turn after the string. Either way the turn is the same."""
    tok = CharTokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, max_seq_len=64)  # every id has a text
    graphdef, params = init_params(cfg, 0)
    engine = JaxEngine(cfg, graphdef, EngineConfig(max_new_tokens=8), eos_id=tok.eos_id, pad_id=tok.pad_id)
    prompt = [Prompt("p/train/0", 0, (tok.bos_id, *tok.encode("12+")))]
    first = run_episodes(engine, params, ScriptedTask(turns=1), prompt, jax.random.key(0), greedy=True).tokens[0]
    assert len(first) >= 4 and tok.eos_id not in first[:4]
    pair = first[2:4]  # two ids the free turn produced after its start
    want = next(i for i in range(len(first) - 1) if first[i:i + 2] == pair) + 2  # its first occurrence, kept
    stop = tok.decode(pair)
    task = StopTask((stop,), turns=1)
    out = run_episodes(engine if where == "engine" else NoStopEngine(engine), params, task, prompt,
                       jax.random.key(0), greedy=True)
    assert out.tokens[0] == first[:want] and tok.decode(out.tokens[0]).endswith(stop)
    assert len(out.logprobs[0]) == len(out.policy_mask[0]) == want == out.generated_tokens
    assert task.seen == [tok.decode(first[:want])]  # the environment saw the turn up to the stop string


def test_the_engine_ends_a_row_at_a_stop_sequence_in_its_loop(model):
    cfg, graphdef, params, _ = model
    engine = JaxEngine(cfg, graphdef, EngineConfig(max_new_tokens=8), eos_id=99, pad_id=0)  # no EOS ever
    prompts = [[1, 4, 5], [1, 6, 7, 8]]
    free = engine.generate(params, prompts, jax.random.key(3), greedy=True)
    assert list(free.lengths) == [8, 8]
    row = free.tokens[0].tolist()
    seq = row[2:4]
    first = next(i for i in range(len(row) - 1) if row[i:i + 2] == seq) + 2
    stopped = engine.generate(params, prompts, jax.random.key(3), greedy=True, stop=[seq, [99, 98, 97]])
    assert int(stopped.lengths[0]) == first and stopped.tokens[0, :first].tolist() == row[:first]
    assert (stopped.tokens[0, first:] == 0).all() and (stopped.logprobs[0, first:] == 0).all()
    np.testing.assert_allclose(stopped.logprobs[0, :first], free.logprobs[0, :first], atol=1e-6)
    other = free.tokens[1].tolist()  # row 1 stops only where it produces seq itself
    want = next((i + 2 for i in range(len(other) - 1) if other[i:i + 2] == seq), 8)
    assert int(stopped.lengths[1]) == want
