"""A parameter tree as a flat list of (path, NumPy array) and back: what crosses a process boundary.

    named = named_arrays(params)              # [("['embed']['embedding'].value", array), ...]
    params = from_named_arrays(template, named)

Paths are jax.tree_util key strings of the tree, so both sides must build the same model (the
actor builds its template from the run's config). A missing, extra or misshapen array is an error
naming the path, never a silent partial load.
"""
from __future__ import annotations

import jax
import numpy as np


def named_arrays(params) -> list[tuple[str, np.ndarray]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    return [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in leaves]


def from_named_arrays(template, named) -> object:
    """A tree shaped like template whose leaves are the named arrays (as JAX arrays)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    given = dict(named)
    if len(given) != len(named):
        raise ValueError("weights: a path appears twice")
    out = []
    for path, leaf in leaves:
        key = jax.tree_util.keystr(path)
        if key not in given:
            raise ValueError(f"weights: {key} is missing")
        a = given.pop(key)
        if tuple(a.shape) != tuple(leaf.shape) or a.dtype != leaf.dtype:
            raise ValueError(f"weights: {key} is {a.dtype} {tuple(a.shape)}, the model has "
                             f"{leaf.dtype} {tuple(leaf.shape)}")
        out.append(jax.numpy.asarray(a))
    if given:
        raise ValueError(f"weights: arrays the model does not have: {sorted(given)[:5]}")
    return jax.tree_util.tree_unflatten(treedef, out)
