"""Tensor-parallel decoding for the built-in engine: a mesh of this process's own devices.

The engine splits the model over a ``tensor`` mesh axis with the learner's logical-axis rules
(learner/sharding.py DEFAULT_RULES, as MaxText does): query heads, KV heads, MLP width and the
vocabulary are split, so each device holds 1 / tensor_parallel of the params and of the KV cache
(an axis the size does not divide, e.g. 2 KV heads on 4 devices, stays whole). The mesh is
(data 1, fsdp 1, tensor N) over the first N local devices, so the same rules table and model code
run unchanged; GSPMD inserts the all-reduces after o_proj and down_proj. The sampler works on
whole logits, replicated on every device (one [B, V] all-gather per step).

    mesh = EngineMesh(4)                     # the first 4 devices of this process
    params = mesh.place(params)              # host, one-device or other-mesh arrays -> shards
    fn = jax.jit(mesh.activations(fn))       # activation layouts pinned while fn is traced
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from cadence.learner import sharding


class EngineMesh:
    """Where the engine's params, cache and inputs live when it decodes on several devices."""

    def __init__(self, tensor_parallel: int, devices=None):
        devices = list(jax.local_devices() if devices is None else devices)
        if tensor_parallel > len(devices):
            raise ValueError(f"engine.tensor_parallel: {tensor_parallel} devices asked, but this process has "
                             f"{len(devices)} ({devices[0].platform})")
        self.mesh = Mesh(np.asarray(devices[:tensor_parallel]).reshape(1, 1, tensor_parallel), sharding.AXES,
                         axis_types=(AxisType.Auto,) * 3)
        self.rules = sharding.parse_rules()
        self.replicated = NamedSharding(self.mesh, P())
        self._shardings: dict = {}  # params treedef -> its shardings
        self._placed: tuple | None = None  # (params given, the same placed): generate() is called per version

    @property
    def size(self) -> int:
        return self.mesh.size

    def shardings(self, params):
        """NamedSharding per param, from the logical names the model's Variables carry (params:
        arrays or ShapeDtypeStructs of the model's nnx.State)."""
        treedef = jax.tree.structure(params)
        if treedef not in self._shardings:
            self._shardings[treedef] = sharding.param_shardings(self.mesh, self.rules, params)
        return self._shardings[treedef]

    def abstract(self, params):
        """params as ShapeDtypeStructs that carry their engine shardings (what a weight receiver
        builds straight into the shards from: named_arrays.ParamLayout)."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            params, self.shardings(params))

    def place(self, params):
        """params split over the mesh (a no-op for arrays already there); the last call's result is
        kept, so the same params object is placed once, not on every generate() call."""
        if self._placed is not None and self._placed[0] is params:
            return self._placed[1]
        placed = jax.device_put(params, self.shardings(params))
        self._placed = (params, placed)
        return placed

    def replicate(self, arrays):
        """Inputs (tokens, masks, keys, scalars) whole on every device of the mesh."""
        return jax.device_put(arrays, self.replicated)

    def activations(self, fn):
        """fn with the rules' activation constraints active while it is traced."""
        return sharding.Layout(self.mesh, self.rules, params=None, abstract=None).activations(fn)


def device_bytes(tree) -> dict:
    """{device id: bytes of the tree's buffers on it} (each shard counted once)."""
    held: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held
