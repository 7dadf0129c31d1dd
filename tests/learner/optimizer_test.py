"""Adam(W) with injected hyperparameters: reference numerics, set/get, clipping, no recompilation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cadence.learner import optimizer as optim
from cadence.learner.config import OptimizerConfig


def _params():
    return {"w": jnp.asarray([[0.5, -1.0], [2.0, 0.1]], jnp.float32), "b": jnp.asarray([0.3, -0.2], jnp.float32)}


def _grads(step):
    rng = np.random.default_rng(step)
    return {"w": jnp.asarray(rng.normal(size=(2, 2)), jnp.float32), "b": jnp.asarray(rng.normal(size=2), jnp.float32)}


def _np_adam_step(p, g, mu, nu, t, lr, b1, b2, eps):
    mu = b1 * mu + (1 - b1) * g
    nu = b2 * nu + (1 - b2) * g * g
    mu_hat, nu_hat = mu / (1 - b1**t), nu / (1 - b2**t)
    return p - lr * mu_hat / (np.sqrt(nu_hat) + eps), mu, nu


def _adam_inner(opt_state):
    """The ScaleByAdamState inside chain(..., inject(adam))."""
    inner = opt_state[-1].inner_state
    return next(s for s in jax.tree.leaves(inner, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu"))


def _step(tx):
    @jax.jit
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return step


def test_matches_numpy_adam_and_set_hyperparams_keeps_moments():
    cfg = OptimizerConfig(lr=0.1, b1=0.8, b2=0.95, eps=1e-6, max_grad_norm=0.0)
    tx = optim.make_optimizer(cfg)
    step = _step(tx)
    params, state = _params(), tx.init(_params())
    ref = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in ref.items()}
    nu = {k: np.zeros_like(v) for k, v in ref.items()}
    hyper = dict(lr=0.1, b1=0.8, b2=0.95, eps=1e-6)
    for t in range(1, 5):
        if t == 3:  # the controller changes everything between steps
            before = _adam_inner(state)
            hyper = dict(lr=0.03, b1=0.7, b2=0.9, eps=1e-4)
            state = optim.set_hyperparams(state, **hyper)
            after = _adam_inner(state)
            for a, b in zip(jax.tree.leaves((before.mu, before.nu, before.count)),
                            jax.tree.leaves((after.mu, after.nu, after.count))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            got = optim.get_hyperparams(state)
            for k, name in (("lr", "learning_rate"), ("b1", "b1"), ("b2", "b2"), ("eps", "eps")):
                np.testing.assert_allclose(got[name], hyper[k], rtol=1e-6)
        g = _grads(t)
        params, state = step(params, state, g)
        for k in ref:
            ref[k], mu[k], nu[k] = _np_adam_step(ref[k], np.asarray(g[k], np.float64), mu[k], nu[k], t, **hyper)
            np.testing.assert_allclose(np.asarray(params[k]), ref[k], rtol=1e-5, atol=1e-6)
    assert step._cache_size() == 1  # new hyperparameter values are new leaves, not new programs


def test_hyperparams_stay_float32_for_bf16_params():
    tx = optim.make_optimizer(OptimizerConfig(lr=3e-4))
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
    state = tx.init(params)
    hyper = optim.hyperparam_arrays(state)
    assert all(v.dtype == jnp.float32 for v in hyper.values())
    state = optim.set_hyperparams(state, learning_rate=1.234567e-4)
    assert optim.hyperparam_arrays(state)["learning_rate"].dtype == jnp.float32
    np.testing.assert_allclose(optim.get_hyperparams(state)["learning_rate"], 1.234567e-4, rtol=1e-6)


def test_global_norm_clipping_scales_the_gradient():
    cfg = OptimizerConfig(lr=0.1, b1=0.9, max_grad_norm=1.0)
    tx = optim.make_optimizer(cfg)
    params = _params()
    state = tx.init(params)
    g = jax.tree.map(lambda x: 10.0 * x, _grads(0))
    norm = float(optax.tree.norm(g))
    assert norm > 1.0
    _, state = tx.update(g, state, params)
    mu = _adam_inner(state).mu
    for k in g:  # first moment = (1 - b1) * clipped gradient
        np.testing.assert_allclose(np.asarray(mu[k]), 0.1 * np.asarray(g[k]) / norm, rtol=1e-5)
    # max_grad_norm = 0 disables clipping.
    tx0 = optim.make_optimizer(dataclasses.replace(cfg, max_grad_norm=0.0))
    _, state0 = tx0.update(g, tx0.init(params), params)
    for k in g:
        np.testing.assert_allclose(np.asarray(_adam_inner(state0).mu[k]), 0.1 * np.asarray(g[k]), rtol=1e-5)


def test_weight_decay_uses_adamw_with_injected_decay():
    cfg = OptimizerConfig(lr=0.1, weight_decay=0.5, max_grad_norm=0.0)
    tx = optim.make_optimizer(cfg)
    params = _params()
    state = tx.init(params)
    assert optim.get_hyperparams(state)["weight_decay"] == 0.5
    zero = jax.tree.map(jnp.zeros_like, params)
    new, _ = _step(tx)(params, state, zero)
    for k in params:  # zero gradient: only the decoupled decay moves the params, by -lr * wd * p
        np.testing.assert_allclose(np.asarray(new[k]), np.asarray(params[k]) * (1 - 0.1 * 0.5), rtol=1e-5)
    assert "weight_decay" not in optim.get_hyperparams(optim.make_optimizer(OptimizerConfig()).init(params))


def test_errors():
    state = optim.make_optimizer(OptimizerConfig()).init(_params())
    with pytest.raises(KeyError, match="momentum"):
        optim.set_hyperparams(state, momentum=0.9)
    with pytest.raises(ValueError, match="inject_hyperparams"):
        optim.get_hyperparams(optax.adam(1e-3).init(_params()))


@pytest.mark.parametrize("field,value", [("lr", 0.0), ("b1", 1.0), ("b2", -0.1), ("eps", 0.0),
                                         ("weight_decay", -1.0), ("max_grad_norm", -1.0)])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        dataclasses.replace(OptimizerConfig(), **{field: value}).validate()
    OptimizerConfig().validate()


@pytest.mark.parametrize("cfg", [OptimizerConfig(lr=1e-2), OptimizerConfig(lr=1e-2, weight_decay=0.1),
                                 OptimizerConfig(lr=1e-2, max_grad_norm=0.0)], ids=["adam", "adamw", "no_clip"])
def test_updates_from_moments_equal_the_chains_update(cfg):
    # The learner applies Adam as its parts (clip, moments, then the step read back from them);
    # three updates, gradients large enough for the clip to bind, against the chain in one call.
    tx, parts = optim.make_optimizer(cfg), optim.optimizer_parts(cfg)
    assert len(parts) == (2 if cfg.max_grad_norm > 0 else 1)
    whole = split = _params()
    s_whole = s_split = tx.init(whole)
    for t in range(3):
        g = jax.tree.map(lambda x: 3.0 * x, _grads(t))
        updates, s_whole = tx.update(g, s_whole, whole)
        whole = optax.apply_updates(whole, updates)
        if len(parts) > 1:
            g, _ = parts[0].update(g, optax.EmptyState())
        _, adam_state = parts[-1].update(g, s_split[-1], split)
        s_split = (*s_split[:-1], adam_state)
        split = optax.apply_updates(split, optim.updates_from_moments(s_split, split))
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
    assert int(_adam_inner(s_split).count) == 3
