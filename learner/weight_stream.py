"""A sharded learner's weights as buckets of its own shards: what actor processes fetch, with no
whole-model copy on any device or on the host.

    source = ShardStream(params, paths, dtype="bfloat16", bucket_bytes=64 << 20)
    server.publish_source(version, source)     # protocols/weights_wire.py serves bucket k on request

Each piece is one device's shard of one parameter (the shard with replica_id 0, so a piece held
by several devices goes once), cut into row blocks where a shard is larger than a bucket. A bucket
is built when an actor asks for it: each piece cast on its own device (the learner's float32
master weights leave as the model's dtype, as `sharding.gather` casts them) and copied to the host;
the server drops it before building the next. So a device holds at most its shards plus one
bucket, and the host one bucket. In a learner of several processes each process streams the
pieces its devices hold; together they are every element of every parameter exactly once.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


class ShardStream:
    """Args:
      params: the learner's params (jax Arrays on its mesh; any tree).
      paths: each leaf's path as actors name it (learner.models.named_arrays.ParamLayout.paths).
      dtype: the dtype weights leave in (None: as held).
      bucket_bytes: the most bytes one bucket holds (a piece larger than this is cut by rows).
    """

    def __init__(self, params, paths: Sequence[str], dtype: str | None, bucket_bytes: int):
        leaves = jax.tree.leaves(params)
        if len(leaves) != len(paths):
            raise ValueError(f"ShardStream: {len(leaves)} arrays but {len(paths)} paths")
        self.params = params  # held: the version stays servable while a transfer of it runs
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        pieces = []  # (path, shard data, offset, whole shape, rows (lo, hi) of the shard or None)
        for path, leaf in zip(paths, leaves):
            out = np.dtype(self.dtype or leaf.dtype)
            for shard in leaf.addressable_shards:
                if shard.replica_id != 0:
                    continue
                shape = shard.data.shape
                offset = [s.indices(n)[0] for s, n in zip(shard.index, leaf.shape)]
                nbytes = math.prod(shape) * out.itemsize
                if nbytes <= bucket_bytes or not shape or shape[0] <= 1:
                    pieces.append((path, shard.data, offset, leaf.shape, None, nbytes))
                    continue
                per_row = nbytes // shape[0]
                step = max(1, bucket_bytes // max(per_row, 1))
                for lo in range(0, shape[0], step):
                    hi = min(lo + step, shape[0])
                    pieces.append((path, shard.data, [offset[0] + lo, *offset[1:]], leaf.shape, (lo, hi),
                                   per_row * (hi - lo)))
        self._buckets: list[list] = []
        size = 0
        for piece in pieces:  # in tree order, greedily: a new bucket when the next piece would overflow
            if not self._buckets or (size + piece[-1] > bucket_bytes and self._buckets[-1]):
                self._buckets.append([])
                size = 0
            self._buckets[-1].append(piece)
            size += piece[-1]
        if not self._buckets:  # this process holds no distinct piece (e.g. every array replicated
            self._buckets.append([])  # on a mesh it does not divide): one empty bucket answers actors
        self.buckets = len(self._buckets)
        self.bucket_bytes = [sum(p[-1] for p in b) for b in self._buckets]

    def bucket(self, k: int) -> list[tuple[str, np.ndarray, list[int], tuple[int, ...]]]:
        out = []
        for path, data, offset, whole, rows, _ in self._buckets[k]:
            if rows is not None:
                data = data[rows[0]:rows[1]]
            if self.dtype is not None and data.dtype != self.dtype:
                data = data.astype(self.dtype)
            out.append((path, np.asarray(data), offset, tuple(whole)))
        return out


