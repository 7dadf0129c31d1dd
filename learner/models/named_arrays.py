"""A parameter tree as a flat list of (path, NumPy array) and back: what crosses a process boundary.

    layout = ParamLayout(template)            # once: paths, shapes and dtypes of the model's tree
    named = layout.named(params)              # [("['embed_tokens']['embedding'].value", array), ...]
    params = layout.build(named)              # JAX arrays in the template's tree

Paths are jax.tree_util key strings of the tree, so both sides must build the same model (the
actor builds its template from the run's config). A missing, extra or misshapen array is an error
naming the path, never a silent partial load. On the CPU, `named` is zero-copy (np.asarray of a
JAX array is a view); `build` copies once, into JAX buffers: on the default device, or, when every
leaf of the template is a ShapeDtypeStruct with a sharding (a tensor-parallel engine's
`abstract_params`), straight into those shards (no device ever holds the whole model).
"""
from __future__ import annotations

import jax
import numpy as np


class ParamLayout:
    def __init__(self, template):
        leaves, self.treedef = jax.tree_util.tree_flatten_with_path(template)
        self.paths = [jax.tree_util.keystr(path) for path, _ in leaves]
        self.specs = {p: (tuple(leaf.shape), np.dtype(leaf.dtype)) for p, (_, leaf) in zip(self.paths, leaves)}
        shardings = [leaf.sharding if isinstance(leaf, jax.ShapeDtypeStruct) else None for _, leaf in leaves]
        self.shardings = shardings if shardings and all(s is not None for s in shardings) else None

    def named(self, params) -> list[tuple[str, np.ndarray]]:
        return [(p, np.asarray(leaf)) for p, leaf in zip(self.paths, jax.tree_util.tree_leaves(params))]

    def build(self, named) -> object:
        given = dict(named)
        if len(given) != len(named):
            raise ValueError("weights: a path appears twice")
        out = []
        for p in self.paths:
            if p not in given:
                raise ValueError(f"weights: {p} is missing")
            a = given.pop(p)
            shape, dtype = self.specs[p]
            if tuple(a.shape) != shape or a.dtype != dtype:
                raise ValueError(f"weights: {p} is {a.dtype} {tuple(a.shape)}, the model has {dtype} {shape}")
            out.append(a)
        if given:
            raise ValueError(f"weights: arrays the model does not have: {sorted(given)[:5]}")
        placed = jax.device_put(out) if self.shardings is None else jax.device_put(out, self.shardings)
        return jax.tree_util.tree_unflatten(self.treedef, placed)  # one call for all arrays


def named_arrays(params) -> list[tuple[str, np.ndarray]]:
    return ParamLayout(params).named(params)


def from_named_arrays(template, named) -> object:
    return ParamLayout(template).build(named)
