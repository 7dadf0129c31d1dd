"""sync="restart": each server restarts on the newly exported checkpoint (sglang-jax, which has no
weight-update endpoint). Only servers Cadence launches can be restarted."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from cadence.actors.config import SGLangConfig
from cadence.actors.sglang.weight_sync.base import CheckpointSync

if TYPE_CHECKING:
    from cadence.actors.sglang.pool import Server, ServerPool


class RestartSync(CheckpointSync):
    method = "restart"

    @classmethod
    def check_config(cls, cfg: SGLangConfig) -> None:
        if cfg.urls:
            raise ValueError("sync: 'restart' needs servers Cadence launches (empty urls); attached servers "
                             "need 'disk'")

    @classmethod
    def for_actor_process(cls, cfg: SGLangConfig, log: Callable[[str], None]) -> SGLangConfig:
        if not cfg.urls:
            return cfg
        log("--sglang-url: attached servers cannot be restarted; weight sync 'disk' (/update_weights_from_disk)")
        return dataclasses.replace(cfg, sync="disk")

    async def load(self, pool: ServerPool, server: Server, model_dir: str, version: int) -> None:
        await pool.restart(server, model_dir, version)
