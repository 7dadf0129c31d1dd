"""Actor.step: a group carries what its engine measured (top-p's kept mass), through the codec."""

import dataclasses

import jax
import numpy as np
import pytest

from actors.actor_loop import Actor
from actors.engine import JaxEngine
from actors.prompt_stream import PromptStream
from actors.tasks.registry import make_task
from launch.config import load_config
from launch.policy import build_policy
from protocols import codec
from protocols.weights import InProcessWeights

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
