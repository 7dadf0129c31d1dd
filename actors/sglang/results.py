"""What the SGLang engine returns, counts and raises (shared by its modules).

GenerationResult and GenerationAborted are the Engine interface's (actors/engine_api.py). The
errors live here, not beside the HTTP client, so the weight-sync methods (and the config validation
that asks them) import no aiohttp."""
from __future__ import annotations

import dataclasses

from cadence.actors.engine_api import GenerationAborted, GenerationResult

__all__ = ["EngineStats", "GenerationAborted", "SGLangError", "SGLangResult", "ServerHTTPError", "ServerUnavailable"]


# What SGLangEngine.generate returns: the Engine's result, policy_versions always set (the weights
# version each row's server held when its request was sent).
SGLangResult = GenerationResult


class ServerUnavailable(ConnectionError):
    """No answer from a server: refused, reset, or past the timeout (client.py raises it)."""


class ServerHTTPError(RuntimeError):
    """A server answered with an HTTP error status (client.py raises it)."""

    def __init__(self, url: str, status: int, text: str):
        super().__init__(f"{url}: HTTP {status}: {text[:300]}")
        self.status = status


class SGLangError(RuntimeError):
    """A request failed more than ``retries`` times, or no server became ready in time."""


@dataclasses.dataclass
class EngineStats:
    """Counters (metrics): written on the engine's event loop, read anywhere."""

    requests: int = 0  # /generate requests sent
    completions: int = 0  # rows returned
    tokens: int = 0
    reissued: int = 0  # requests sent again after a failure of any kind
    misaligned: int = 0  # responses rejected by the alignment check
    malformed: int = 0  # responses that were not the promised JSON
    unavailable: int = 0  # requests that found their server gone (refused, reset, timed out)
    http_errors: int = 0
    restarts: int = 0  # owned servers restarted after a failure
    syncs: int = 0  # weight syncs completed
    sync_seconds: float = 0.0  # total time inside sync_weights (export + restart/load/broadcast)
    sync_bytes: int = 0  # sent by distributed syncs (per server: one broadcast reaches all)
    sync_failures: int = 0  # distributed sync attempts that failed and were retried or raised
