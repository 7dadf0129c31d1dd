"""learner.remat: the same gradients, and on XLA:CPU the memory it promises.

XLA:CPU expands jax.checkpoint's optimization barriers before its common-subexpression pass,
which then merges each recomputed block with its forward twin and keeps every activation
(learner/models/llama.py _ordered_backward). The compiled gradient's temporary buffers tell
whether a block's activations are kept: without remat they grow with the layers by a block's
activations, with "full" by about the block's input."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cadence.learner.models import llama
from cadence.learner.models.config import ModelConfig

ROWS, T = 2, 128


def _model(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=64, n_layers=layers, n_heads=4, n_kv_heads=2,
                       d_ff=256, max_seq_len=T)


def _inputs():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 64, (ROWS, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (ROWS, T))
    mask = jnp.ones((ROWS, T), bool)
    return tokens, positions, mask


def _grad_fn(graphdef, remat: str):
    def loss(params, tokens, positions, mask):
        logits = llama.forward(graphdef, params, tokens, positions, mask, remat=remat)
        return jax.nn.log_softmax(logits)[..., 0].mean()
    return jax.jit(jax.grad(loss))


@pytest.mark.parametrize("remat", ["block", "full"])
def test_remat_gives_the_gradients_without_it(remat):
    graphdef, params = llama.init_params(_model(3), seed=0)
    args = _inputs()
    want = _grad_fn(graphdef, "none")(params, *args)
    got = _grad_fn(graphdef, remat)(params, *args)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        w = np.asarray(w)  # float32 sums in another order: rounding apart
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6 * np.abs(w).max())


def _temp_bytes(layers: int, remat: str) -> int:
    graphdef, params = llama.abstract_params(_model(layers))
    compiled = _grad_fn(graphdef, remat).lower(params, *_inputs()).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_full_remat_keeps_a_blocks_input_not_its_activations():
    block_input = ROWS * T * 64 * 4  # [rows, T, d_model] float32
    per_layer = {remat: (_temp_bytes(6, remat) - _temp_bytes(2, remat)) / 4 for remat in ("none", "full")}
    print(per_layer, block_input)
    assert per_layer["none"] > 8 * block_input  # q/k/v, attention weights, the MLP's d_ff-wide tensors
    assert per_layer["full"] <= 2 * block_input
