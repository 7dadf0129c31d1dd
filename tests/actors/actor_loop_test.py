"""Actor.step: a group carries what its engine measured (top-p's kept mass), through the codec."""

import dataclasses

import jax
import numpy as np
import pytest

from cadence.actors.actor_loop import Actor
from cadence.actors.engine import JaxEngine
from cadence.actors.prompt_stream import PromptStream
from cadence.actors.tasks.registry import make_task
from cadence.launch.config import load_config
from cadence.learner.models.policy import build_policy
from cadence.protocols import codec
from cadence.protocols.weights import InProcessWeights

G = 4


def _actor(top_p: float):
    cfg = load_config()
    policy = build_policy(cfg)
    engine = JaxEngine(policy.model_cfg, policy.graphdef, dataclasses.replace(cfg.engine, top_p=top_p),
                       policy.tokenizer.eos_id, policy.tokenizer.pad_id)
    task = make_task(cfg.task, policy.tokenizer)
    stream = PromptStream(task)
    actor = Actor("a0", engine, task, None, InProcessWeights(policy.params, 0), G, 2, seed=0)
    return actor, stream, engine, policy.params


@pytest.mark.parametrize("top_p", [0.7, 1.0])
def test_groups_carry_the_kept_top_p_mass_of_each_token(top_p):
    actor, stream, engine, params = _actor(top_p)
    prompts = stream.take(2)
    groups = actor.step(prompts)
    if top_p == 1.0:  # nothing truncated: nothing sent
        assert all(g.kept_logmass is None for g in groups)
        return
    # The engine's own numbers for the same call (same key: a function of the prompts).
    rows = [list(p.tokens) for p in prompts for _ in range(G)]
    ref = engine.generate(params, rows, jax.random.fold_in(actor.rng, prompts[0].index))
    for i, g in enumerate(groups):
        assert len(g.kept_logmass) == G
        for j, (ids, kept) in enumerate(zip(g.completion_tokens, g.kept_logmass)):
            r = i * G + j
            assert len(kept) == len(ids) == int(ref.lengths[r])
            np.testing.assert_allclose(kept, ref.kept_logmass[r, :len(ids)], rtol=1e-6)
        assert any(k < 0 for kept in g.kept_logmass for k in kept)  # the nucleus cut something
        back = codec.decode(codec.encode(g))  # an optional field: no schema bump
        assert back.kept_logmass == g.kept_logmass


def test_a_hanging_environment_does_not_hang_the_actor(tmp_path):
    """A real actor step on the calculator example whose tool never answers for one prompt: that
    prompt's episodes end at task.env_timeout_s, scored 0 and counted (env_timeout) in the groups
    the learner gets; the other prompts' episodes are untouched."""
    import threading
    import time

    from cadence.actors.env_runner import EnvRunner

    cfg = load_config(files=["examples/calculator/config.yaml"], overrides=["task.env_timeout_s=0.5"])
    policy = build_policy(cfg)
    engine = JaxEngine(policy.model_cfg, policy.graphdef, cfg.engine, policy.tokenizer.eos_id, policy.tokenizer.pad_id)
    task = make_task(cfg.task, policy.tokenizer)
    release, build = threading.Event(), task.environment

    class HangingTool:
        def __init__(self, env):
            self.env = env

        def step(self, turn):
            release.wait()  # the tool never answers (until the test ends)
            return self.env.step(turn)

    prompts = PromptStream(task).take(3)
    task.environment = lambda p: HangingTool(build(p)) if p.index == prompts[1].index else build(p)
    actor = Actor("a0", engine, task, None, InProcessWeights(policy.params, 0), G, 3, seed=0,
                  envs=EnvRunner.from_config(cfg.task))
    t0 = time.monotonic()
    try:
        groups = actor.step(prompts)
    finally:
        release.set()
    assert time.monotonic() - t0 < 60  # without the limit: never
    assert groups[1].reward_errors == ["env_timeout"] * G and groups[1].rewards == [0.0] * G
    assert groups[0].reward_errors is None and groups[2].reward_errors is None
    assert codec.decode(codec.encode(groups[1])).reward_errors == ["env_timeout"] * G


def test_held_out_evaluation_in_chunks_on_actors_equals_the_learner_s_own():
    """Two actors each evaluate a chunk of the held-out set (greedy, weights of the granted version);
    the learner's aggregation of their results (through the codec) is evaluate_heldout's, exactly."""
    from cadence.actors.evaluation import evaluate_heldout, heldout_metrics
    from cadence.actors.tasks.base import Score
    from cadence.protocols.messages import EvalGrant

    actor, _, engine, params = _actor(1.0)
    heldout = actor.task.heldout()
    want = evaluate_heldout(engine, actor.task, params)
    chunks = [list(range(0, len(heldout), 2)), list(range(1, len(heldout), 2))]  # interleaved: order matters
    scores = {}
    for n, chunk in enumerate(chunks):
        grant = EvalGrant(eval_id=f"e-{n}", prompt_indices=chunk, prompt_ids=[heldout[i].prompt_id for i in chunk],
                          version=0, session="s")
        result = codec.decode(codec.encode(actor.evaluate(grant)))
        assert result.version == 0 and result.prompt_indices == chunk and result.num_tokens > 0
        for k, i in enumerate(chunk):
            scores[i] = Score(result.rewards[k], result.exact_match[k],
                              {name: v[k] for name, v in result.task_metrics.items()}, result.reward_errors[k])
    got = heldout_metrics([scores[i] for i in range(len(heldout))], heldout)
    assert got == want and 0 < want["eval/reward"] < 1, (got, want)
    # a held-out set that differs from the learner's (another task config) is refused, naming why
    bad = EvalGrant(eval_id="e-x", prompt_indices=[0], prompt_ids=["other/heldout/0"], version=0, session="s")
    with pytest.raises(ValueError, match="task config or data differ"):
        actor.evaluate(bad)
