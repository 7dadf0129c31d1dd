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
    hyper = dict(learning_rate=cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    if cfg.weight_decay > 0:
        adam = optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)(
            weight_decay=cfg.weight_decay, **hyper
        )
    else:
        adam = optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.float32)(**hyper)
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adam)
    return optax.chain(adam)


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
