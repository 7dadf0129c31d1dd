"""The WeightSync interface: how an SGLang engine's servers get a new weights version.

    method = weight_sync_method(cfg.sync)        # the registry (weight_sync/__init__.py)
    method.check_config(cfg)                     # its own config rules (SGLangConfig.validate calls it)
    sync = method(cfg, exports, tensors_fn=..., gather_fn=...)
    pool = ServerPool(cfg, work_dir, stats, exports, sync)
    with pool.sync_lock:
        changed = sync.update(pool, params, version)   # every server to `version`, or raises SGLangError

SGLangEngine.sync_weights (engine.py) decides WHEN (needs_sync: the staleness bound, sync_every) and
holds the pool's sync lock; a WeightSync decides HOW. Every method leaves requests alone: a server
leaves the rotation (pool.drain), its running requests finish under the old version, then it gets the
new weights and rejoins. The pool asks the method twice more: when an owned server was restarted
after a failure (restarted: may it serve the checkpoint it started on?) and when an attached server
answers again (rejoin). One class per method, one file each; a new method (LoRA adapters, NIXL) is a
subclass here and a line in the registry.
"""
from __future__ import annotations

import abc
import asyncio
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from cadence.actors.config import SGLangConfig
from cadence.actors.sglang.results import SGLangError

if TYPE_CHECKING:
    from cadence.actors.sglang.pool import Exports, Server, ServerPool


class WeightSync(abc.ABC):
    """One way of bringing the servers to new weights (see the module docstring)."""

    method: ClassVar[str]  # its actors.sglang.sync value

    def __init__(self, cfg: SGLangConfig, exports: Exports, *, tensors_fn: Callable[[Any], list] | None = None,
                 gather_fn: Callable[[list], list] | None = None):
        """exports: the newest checkpoint (written here, loaded by restarts); tensors_fn(params): the
        HF tensors a method that sends tensors sends (hf_export.hf_tensors); gather_fn(arrays): those
        arrays whole on this process, a bucket at a time (a learner sharded over processes)."""
        self.cfg, self.exports, self.tensors_fn, self.gather_fn = cfg, exports, tensors_fn, gather_fn

    @classmethod
    def check_config(cls, cfg: SGLangConfig) -> None:
        """Raises ValueError("<field>: <problem>") for settings this method cannot work with."""

    @classmethod
    def for_actor_process(cls, cfg: SGLangConfig, log: Callable[[str], None]) -> SGLangConfig:
        """cfg as one `cadence actor` process drives its servers (cfg.urls: attached by
        --sglang-url; else launched beside it); may name another method that fits better."""
        return cfg

    @abc.abstractmethod
    def update(self, pool: ServerPool, params, version: int) -> bool:
        """Brings every server that answers to ``version``; False when nothing changed. Called from a
        caller's thread with pool.sync_lock held; blocks until done. Raises SGLangError."""

    def restarted(self, server: Server, version: int) -> bool:
        """An owned server restarted after a failure, on the newest exported checkpoint (``version``);
        True keeps it out of rotation until the next update (its checkpoint is not what is served)."""
        return False

    async def rejoin(self, pool: ServerPool, server: Server) -> None:
        """An attached server that was down answers again (on the pool's loop): back in rotation."""
        server.ready, server.down = True, False


class CheckpointSync(WeightSync):
    """Methods that export a checkpoint and have each server take it, one server at a time."""

    def update(self, pool: ServerPool, params, version: int) -> bool:
        model_dir = self.exports.write(params, version)
        pool.call(self._sync_all(pool, model_dir, version))
        return True

    @abc.abstractmethod
    async def load(self, pool: ServerPool, server: Server, model_dir: str, version: int) -> None:
        """The drained server takes model_dir (``version``) and rejoins; one that does not answer
        is marked down (pool.mark_down) and left out."""

    async def _sync_all(self, pool: ServerPool, model_dir: str, version: int) -> None:
        await asyncio.gather(*(self._sync_one(pool, s, model_dir, version) for s in pool.servers))
        if not any(s.ready or s.recovering is not None for s in pool.servers):
            raise SGLangError(f"weight sync to version {version}: no SGLang server answered")

    async def _sync_one(self, pool: ServerPool, server: Server, model_dir: str, version: int) -> None:
        if server.recovering is not None:  # a restart in progress picks up the new model_dir itself
            await asyncio.shield(server.recovering)
            if server.version == version:
                return
        await pool.drain(server)
        await self.load(pool, server, model_dir, version)
