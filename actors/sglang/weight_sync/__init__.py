"""Weight sync of SGLang servers: one WeightSync class per actors.sglang.sync method (base.py has
the interface), chosen here and nowhere else.

    sync = weight_sync_method(cfg.sync)(cfg, exports, tensors_fn=..., gather_fn=...)

  restart      restarts each server on the newly exported checkpoint (sglang-jax)   restart.py
  disk         each server loads it with /update_weights_from_disk (main SGLang)    disk.py
  distributed  a torch.distributed broadcast from the learner to every server        distributed.py

A new method is a new file with a WeightSync subclass, one line in METHODS, and its name among
SGLangConfig.sync's choices (tests/actors/weight_sync_test.py checks the two agree).
"""
from __future__ import annotations

from cadence.actors.sglang.weight_sync.base import CheckpointSync, WeightSync
from cadence.actors.sglang.weight_sync.disk import DiskSync
from cadence.actors.sglang.weight_sync.distributed import DistributedSync
from cadence.actors.sglang.weight_sync.restart import RestartSync

METHODS: dict[str, type[WeightSync]] = {m.method: m for m in (RestartSync, DiskSync, DistributedSync)}

__all__ = ["METHODS", "CheckpointSync", "DiskSync", "DistributedSync", "RestartSync", "WeightSync",
           "weight_sync_method"]


def weight_sync_method(name: str) -> type[WeightSync]:
    """The class of actors.sglang.sync = name; ValueError naming the key for an unknown one."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise ValueError(f"sync: must be one of {', '.join(repr(m) for m in METHODS)}, got {name!r}") from None
