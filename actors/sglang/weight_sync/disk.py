"""sync="disk": each server loads the newly exported checkpoint with /update_weights_from_disk
(main SGLang); attached servers too. One that comes back after a failure loads the newest first."""
from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.actors.sglang.results import ServerHTTPError, ServerUnavailable
from cadence.actors.sglang.weight_sync.base import CheckpointSync

if TYPE_CHECKING:
    from cadence.actors.sglang.pool import Server, ServerPool


class DiskSync(CheckpointSync):
    method = "disk"

    async def load(self, pool: ServerPool, server: Server, model_dir: str, version: int) -> None:
        try:
            await server.client.update_weights_from_disk(model_dir, version)
        except ServerUnavailable:  # dead: out of rotation; the heartbeat loads the newest when it is back
            pool.mark_down(server)
            return
        server.version, server.ready, server.down = version, True, False

    async def rejoin(self, pool: ServerPool, server: Server) -> None:
        newest, version = self.exports.model_dir, self.exports.model_version
        if newest and server.version != version:
            try:
                await server.client.update_weights_from_disk(newest, version)
                server.version = version
            except (ServerUnavailable, ServerHTTPError, RuntimeError):
                return  # tried again at the next heartbeat
        server.ready, server.down = True, False
