"""A train step given only a process's rows plus the whole batch's counts (WholeBatch), as each
process of a multi-process learner is (learner/leader.py), trains exactly as on the whole batch.
On one process its rows are all rows (Layout.process_rows), so the two updates must agree to the
bit; tests/learner/multihost_test.py runs the cut across two real processes."""
import dataclasses
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from grpo_step_test import PAD, T, V, make_groups  # noqa: E402  (shared stand-in groups)

from cadence.learner import sharding  # noqa: E402
from cadence.learner.batching import build_microbatches  # noqa: E402
from cadence.learner.config import LearnerConfig, MeshConfig, OptimizerConfig  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.config import ModelConfig  # noqa: E402
from cadence.learner.steps import make_train_step  # noqa: E402
from cadence.learner.steps.grpo_step import whole_batch  # noqa: E402

MODEL = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=T)


@pytest.mark.parametrize("algorithm,minibatches", [("grpo", 1), ("grpo", 2), ("ppo", 1)])
def test_update_from_process_rows_and_whole_counts_equals_the_whole_batch(algorithm, minibatches):
    _, abstract = llama.abstract_params(MODEL)
    layout = sharding.make_layout(MeshConfig(), abstract, force=True)  # one device, the sharded program
    graphdef, params = llama.init_params(MODEL, 0, layout.params)
    cfg = LearnerConfig(algorithm=algorithm, batch_size=16, microbatch_size=4, group_size=4,
                        minibatches=minibatches, optimizer=OptimizerConfig(lr=1e-2))
    step = make_train_step(graphdef, cfg, layout)
    mbs, stats = build_microbatches(make_groups(4, seed=3), T, 4, PAD, step.cfg.grpo)
    whole = whole_batch(mbs)
    assert whole.rows == 4 and len(whole.sequences) == len(mbs) == 4
    assert layout.process_rows(whole.rows, 0).tolist() == [0, 1, 2, 3]
    a, ma = step.update(step.init(params), mbs, stats["num_tokens"])
    rows = layout.process_rows(whole.rows, 0)
    mine = [type(mb)(*(None if x is None else np.asarray(x)[rows] for x in mb)) for mb in mbs]
    b, mb_ = step.update(step.init(params), mine, stats["num_tokens"], whole=whole)
    assert ma["loss"] == mb_["loss"] and ma["microbatch_tokens"] == mb_["microbatch_tokens"]
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
