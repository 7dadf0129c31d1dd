"""Adam(W) with global-norm clipping whose hyperparameters live in the optimizer state.

The batch-size controller changes lr / b1 / b2 / eps between steps. They are injected with
optax.inject_hyperparams, so they are float32 arrays inside opt_state: changing them is a pytree
leaf update (same structure, dtype, shape), which never triggers a recompilation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cadence.learner.config import OptimizerConfig


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """chain(clip_by_global_norm (if max_grad_norm > 0), inject_hyperparams(adam or adamw)).

    Plain Adam when weight_decay == 0 (saves a pass over the params), AdamW otherwise; in that case
    weight_decay is an injected hyperparameter too. Hyperparameters are kept in float32 whatever
    the params' dtype (a bf16 learning rate would be rounded to 3 digits).
    """
    return optax.chain(*optimizer_parts(cfg))


def optimizer_parts(cfg: OptimizerConfig) -> tuple[optax.GradientTransformation, ...]:
    """make_optimizer's chain as its parts: (clip_by_global_norm,) if max_grad_norm > 0, then
    inject_hyperparams(adam[w]); its state is one per part, in this order."""
    hyper = dict(learning_rate=cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    if cfg.weight_decay > 0:
        adam = optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)(
            weight_decay=cfg.weight_decay, **hyper
        )
    else:
        adam = optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.float32)(**hyper)
    if cfg.max_grad_norm > 0:
        return optax.clip_by_global_norm(cfg.max_grad_norm), adam
    return (adam,)


def _is_inject_state(x: Any) -> bool:
    return isinstance(x, (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState))


def _map_inject_states(opt_state: Any, fn) -> Any:
    """Applies fn to every inject_hyperparams state inside a (nested tuple) optax state."""
    if _is_inject_state(opt_state):
        return fn(opt_state)
    if isinstance(opt_state, tuple) and not hasattr(opt_state, "_fields"):
        return tuple(_map_inject_states(s, fn) for s in opt_state)
    return opt_state


def _find_inject_state(opt_state: Any):
    found = []
    _map_inject_states(opt_state, lambda s: found.append(s) or s)
    if not found:
        raise ValueError("opt_state holds no inject_hyperparams state (use make_optimizer)")
    return found[0]


def hyperparam_arrays(opt_state: Any) -> dict[str, jax.Array]:
    """The injected hyperparameters as they sit in opt_state (arrays; usable inside jit)."""
    return dict(_find_inject_state(opt_state).hyperparams)


def get_hyperparams(opt_state: Any) -> dict[str, float]:
    """The injected hyperparameters as host floats, e.g. {"learning_rate": 3e-4, "b1": 0.9, ...}."""
    return {k: float(v) for k, v in jax.device_get(hyperparam_arrays(opt_state)).items()}


def set_hyperparams(opt_state: Any, **values: float) -> Any:
    """Returns opt_state with the given injected hyperparameters replaced (functional).

    Keeps the pytree structure, dtypes and shapes, and Adam's moments and count, so a jitted
    update sees the same signature and does not recompile. Accepts `lr` as an alias of
    `learning_rate`. Raises KeyError for a name the optimizer does not have.
    """
    if "lr" in values:
        values["learning_rate"] = values.pop("lr")

    def replace(state):
        unknown = set(values) - set(state.hyperparams)
        if unknown:
            raise KeyError(f"unknown hyperparameters {sorted(unknown)}; have {sorted(state.hyperparams)}")
        hyperparams = dict(state.hyperparams)
        for name, value in values.items():
            old = hyperparams[name]
            new = np.asarray(value, dtype=old.dtype).reshape(old.shape)
            if getattr(old, "committed", False):
                # Same placement keeps the jit signature (a mesh's replicated sharding included:
                # from host data every process places its own copy); an uncommitted value stays
                # uncommitted (committedness is part of jit's cache key too).
                hyperparams[name] = jax.device_put(new, old.sharding)
            else:
                hyperparams[name] = jnp.asarray(new)
        return state._replace(hyperparams=hyperparams)

    _find_inject_state(opt_state)  # raise if there is none
    return _map_inject_states(opt_state, replace)


def updates_from_moments(opt_state: Any, params: Any) -> Any:
    """The update make_optimizer's Adam(W) takes, read from its state *after* optimizer.update:
    -lr * (mu_hat / (sqrt(nu_hat) + eps) + weight_decay * params), the moments' bias corrected
    by 1 - b**count (optax's scale_by_adam with eps_root 0, add_decayed_weights,
    scale_by_learning_rate).

    Why: in one program XLA:CPU fuses the moments' update into the params' and then reads the old
    moments after writing the new ones into their (donated) buffers, so it copies all of nu
    first; and the clipped gradient, read by both moments' updates, is materialised: each a
    model-sized temporary (0.54 GB at SmolLM2). Applied as three programs (clip the gradient in
    place, the moments in place, then the params from them: learner.steps.grpo_step.AdamInParts)
    nothing model-sized is made but the new params."""
    inject = _find_inject_state(opt_state)
    adam = inject.inner_state[0] if isinstance(inject.inner_state, tuple) else inject.inner_state
    if not isinstance(adam, optax.ScaleByAdamState):
        raise ValueError(f"opt_state's inner state is {type(adam).__name__}, not Adam's (use make_optimizer)")
    hp = inject.hyperparams
    correct_mu = 1 - hp["b1"] ** adam.count
    correct_nu = 1 - hp["b2"] ** adam.count
    decay = hp.get("weight_decay")

    def update(mu, nu, param):
        direction = (mu / correct_mu.astype(mu.dtype)) / (jnp.sqrt(nu / correct_nu.astype(nu.dtype)) + hp["eps"])
        if decay is not None:
            direction = direction + decay * param
        return -hp["learning_rate"] * direction

    return jax.tree.map(update, adam.mu, adam.nu, params)
